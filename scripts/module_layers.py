"""Print the package's modules in dependency order, for docs/architecture.md.

A module's layer is one more than the highest layer among the package modules
it imports (module level and inside functions; package ``__init__`` files that
only re-export are left out), so every import points to a lower layer. The
import graph has no cycle (``tests/test_structure.py`` checks it), so the
layers are well defined.

Run from the repository root::

    python scripts/module_layers.py
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"torchrec_kvemb": ROOT / "torchrec_kvemb", "torchrec_kvemb.kernels": ROOT / "kernels"}


def modules() -> dict[str, Path]:
    out = {}
    for prefix, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            if path.name == "__init__.py":
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            out[".".join([prefix, *parts])] = path
    return out


MODULES = modules()


def imports(name: str) -> set[str]:
    """The package modules ``name`` imports (``from pkg import mod`` counts ``mod``)."""
    here = name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        sources: list[str] = []
        if isinstance(node, ast.Import):
            sources = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            sources = [base] + [f"{base}.{a.name}" for a in node.names]
        found |= {s for s in sources if s in MODULES and s != name}
    return found


@cache
def layer(name: str) -> int:
    below = [layer(m) for m in imports(name)]
    return 1 + max(below) if below else 0


def main() -> None:
    by_layer: dict[int, list[str]] = {}
    for name in MODULES:
        by_layer.setdefault(layer(name), []).append(name.removeprefix("torchrec_kvemb."))
    for level in sorted(by_layer, reverse=True):
        print(f"{level:2d}  {'  '.join(sorted(by_layer[level]))}")


if __name__ == "__main__":
    main()
