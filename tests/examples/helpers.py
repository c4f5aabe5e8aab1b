"""What the example tests share: the scripts' place, tiny flags, running a job,
importing ``examples/common``.

Example::

    job = train_tiny(tmp_path / "demo", steps=4)
    criteo = load_example("common.criteo")
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from tests.torchrun_jobs import ROOT, run_job, torchrun_command

EXAMPLES = ROOT / "examples"
#: Flags of a tiny training run: small batches, KV capacities small enough that
#: tables evict (and the SSD tier is used).
TINY = [
    "--batch-size", "64",
    "--eval-batches", "2",
    "--kv-capacity", "512",
    "--stock-rows", "1000",
    "--log-every", "2",
]  # fmt: skip


def load_example(name: str) -> ModuleType:
    """A module of ``examples/`` by its name there (``"common.criteo"``): the scripts'
    directory is not a package, they import from it as their own."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


def run_example(command: list[str]) -> subprocess.CompletedProcess:
    """Run an example job as a user does (no ``TRITON_INTERPRET``); its stdout goes
    to the test log; it must exit 0."""
    job = run_job(command, timeout=300, triton_interpret=False)
    print(job.stdout)
    assert job.returncode == 0, f"exit {job.returncode}\n{job.stdout[-3000:]}\n{job.stderr[-6000:]}"
    return job


def train_tiny(workdir: Path, steps: int) -> subprocess.CompletedProcess:
    """``train_dlrm.py`` on 2 ranks with the tiny flags, into ``workdir``."""
    script = str(EXAMPLES / "train_dlrm.py")
    return run_example(
        torchrun_command(2, script, "--workdir", str(workdir), "--steps", str(steps), *TINY)
    )
