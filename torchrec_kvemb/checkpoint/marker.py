"""The ``COMPLETE`` marker of a checkpoint directory, and its atomic publication.

A save writes its files into ``<path>.tmp-<token>``; :func:`publish` (rank 0,
after every rank wrote) moves that directory to ``path`` and then writes the
marker: JSON with the format, the world size, the KV tables' configs and their
:func:`fingerprint`. A directory without it is an unfinished save, which
:func:`read_marker` refuses.

Example::

    marker = read_marker("/ckpt/step_1000")
    marker["world_size"], marker["tables"]["ebc.embedding_bags.user"]["dim"]
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from typing import Any

from torchrec_kvemb.state_dict.checks import CheckpointError

#: File whose presence says the checkpoint directory is complete (JSON: format,
#: world size, KV tables and their fingerprint).
MARKER = "COMPLETE"
FORMAT = "torchrec_kvemb.checkpoint"
VERSION = 1


def check_target(path: str) -> None:
    """``path`` may receive a checkpoint: absent, an empty directory or a checkpoint."""
    if os.path.lexists(path) and not (
        os.path.isdir(path)
        and (os.path.exists(os.path.join(path, ".metadata")) or not os.listdir(path))
    ):
        raise CheckpointError(
            f"{path!r} exists and is not a checkpoint directory: refusing to replace it"
        )


def publish(tmp: str, path: str, token: str, tables: dict, world_size: int) -> None:
    """Rank 0, after every rank wrote its files: move the directory into place, then
    write the marker (a crash before it leaves a directory that ``load`` refuses)."""
    old = None
    if os.path.lexists(path):
        old = f"{path}.old-{token}"
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    write_marker(path, tables, world_size)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_marker(path: str, tables: dict, world_size: int) -> None:
    marker = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": world_size,
        "fingerprint": fingerprint(tables),
        "tables": tables,
    }
    tmp = os.path.join(path, MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(marker, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, os.path.join(path, MARKER))
    fsync_dir(path)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fingerprint(tables: Mapping[str, Mapping[str, Any]]) -> str:
    """A hash of the KV tables' config that a checkpoint must match: names (by
    state_dict prefix), dims and optimizers."""
    key = {prefix: [t["name"], t["dim"], t["optimizer"]] for prefix, t in sorted(tables.items())}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def read_marker(path: str | os.PathLike) -> dict[str, Any]:
    """The ``COMPLETE`` marker of the checkpoint at ``path``; raises
    :class:`CheckpointError` if there is no complete checkpoint there."""
    path = os.fspath(path)
    marker = os.path.join(path, MARKER)
    if not os.path.isdir(path):
        parent = os.path.dirname(os.path.abspath(path)) or "."
        base = os.path.basename(os.path.abspath(path))
        partial = [n for n in os.listdir(parent) if n.startswith(base + ".tmp-")]
        hint = f" (an unfinished save left {partial[0]!r})" if partial else ""
        raise CheckpointError(f"no checkpoint at {path!r}{hint}")
    if not os.path.exists(marker):
        raise CheckpointError(
            f"checkpoint {path!r} is incomplete: it has no {MARKER} marker (the save "
            "was interrupted before every rank had written its files)"
        )
    with open(marker) as f:
        data = json.load(f)
    if data.get("format") != FORMAT or data.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint {path!r}: unknown format {data.get('format')!r} "
            f"version {data.get('version')!r}"
        )
    return data
