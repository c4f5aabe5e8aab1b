"""The package's structure: every module imports on its own, no module imports a
private name of another or reaches a private attribute another module defines,
and the import graph has no cycle.

The graph is the one Python follows at import time: an edge for every
``import`` / ``from ... import`` of the package (module level and inside
functions), to the module imported (``from pkg import submodule`` goes to the
submodule), plus one to each package whose ``__init__`` that import runs (for an
importer outside that package). Cycles are reported as a path of modules.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "torchrec_kvemb"
#: Source folders of the package: ``kernels/`` installs as ``torchrec_kvemb.kernels``.
SOURCES = {PACKAGE: ROOT / "torchrec_kvemb", f"{PACKAGE}.kernels": ROOT / "kernels"}
#: Cycles between sub-packages that are known (none: the kernels and the torch paths
#: import only ``contracts``; ``dispatch`` sits above both).
KNOWN_PACKAGE_CYCLES: list[list[str]] = []


def package_modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    modules = {}
    for prefix, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([prefix, *parts])] = path
    return modules


MODULES = package_modules()
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def imports_of(name: str) -> list[tuple[str, str | None, int]]:
    """``(module imported, name imported from it or None, line)`` for every import of
    the package in module ``name`` (module level and inside functions)."""
    path = MODULES[name]
    here = name if name in PACKAGES else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if _ours(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if _ours(source):
                out += [(source, a.name, node.lineno) for a in node.names]
    return out


def private_definitions(name: str) -> set[str]:
    """The private names (``_x``, not dunders) module ``name`` defines: its functions,
    classes and methods, names assigned at module or class level, and attributes
    assigned as ``self._x = ...`` / ``cls._x = ...`` (annotated, augmented or
    unpacked assignments included)."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    names: set[str] = set()

    def targets(node: ast.AST) -> list[ast.AST]:
        if isinstance(node, ast.Assign):
            return node.targets
        if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            return [node.target]
        return []

    scopes = [tree.body, *(n.body for n in ast.walk(tree) if isinstance(n, ast.ClassDef))]
    for body in scopes:  # module and class level: plain names
        for statement in body:
            for target in targets(statement):
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        for target in targets(node):
            for sub in ast.walk(target):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id in ("self", "cls")
                ):
                    names.add(sub.attr)
    return {n for n in names if _private(n)}


def private_accesses(name: str) -> list[tuple[str, int, str]]:
    """``(attribute, line, expression)`` of every ``x._name`` in module ``name`` whose
    object is not ``self``, ``cls`` or ``super()`` (dunders left out)."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        value = node.value
        if isinstance(value, ast.Name) and value.id in ("self", "cls"):
            continue
        if (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id == "super"
        ):
            continue
        out.append((node.attr, node.lineno, ast.unparse(node)))
    return out


def _private(attr: str) -> bool:
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def _ours(module: str) -> bool:
    return module == PACKAGE or module.startswith(PACKAGE + ".")


def _existing(module: str) -> str:
    while module not in MODULES:
        module = module.rpartition(".")[0]
    return module


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name in MODULES:
        for source, imported, _ in imports_of(name):
            target = f"{source}.{imported}" if imported else source
            target = target if target in MODULES else _existing(source)
            parts = target.split(".")
            # Importing a.b.c runs a.b's __init__ (a is the root, already running).
            parents = [".".join(parts[:i]) for i in range(2, len(parts))]
            for node in [target, *parents]:
                if node != name and not name.startswith(node + "."):
                    graph[name].add(node)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def cycle_path(graph: dict[str, set[str]], component: list[str]) -> str:
    """One cycle through a component, as ``a -> b -> ... -> a``."""
    members = set(component)
    start = component[0]
    path, seen = [start], {start}
    node = start
    while True:
        succ = sorted(s for s in graph[node] if s in members)
        if start in succ and len(path) > 1:
            return " -> ".join([*path, start])
        nxt = next((s for s in succ if s not in seen), None)
        if nxt is None:
            return " -> ".join([*path, start])
        path.append(nxt)
        seen.add(nxt)
        node = nxt


def sub_package(module: str) -> str:
    parts = module.split(".")
    top = ".".join(parts[:2])
    return top if top in PACKAGES and top != PACKAGE else module


# ------------------------------------------------------------------ tests
#: Imports each module first in a fresh interpreter, with none of the package
#: loaded (its modules are dropped from ``sys.modules`` before each; the libraries
#: it builds on stay, so torch is imported once).
_IMPORT_EACH = """
import importlib, json, sys, traceback
import torch, torchrec, fbgemm_gpu, triton  # noqa: F401
failed = {}
for module in sys.argv[1:]:
    for name in [n for n in sys.modules if n.split(".")[0] == "torchrec_kvemb"]:
        del sys.modules[name]
    try:
        importlib.import_module(module)
    except BaseException:
        failed[module] = traceback.format_exc()[-3000:]
print(json.dumps(failed))
"""


def test_every_module_imports_on_its_own():
    # why two processes: each import starts from an empty package, about 0.4 s a
    # module; two halves side by side keep the test's time on 2 cores.
    names = sorted(MODULES)
    jobs = [
        subprocess.Popen(
            [sys.executable, "-c", _IMPORT_EACH, *names[half::2]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for half in (0, 1)
    ]
    failed: dict[str, str] = {}
    for job in jobs:
        out, err = job.communicate(timeout=600)
        assert job.returncode == 0, err[-3000:]
        failed.update(json.loads(out.strip().splitlines()[-1]))
    assert not failed, "\n\n".join(f"{m}:\n{err}" for m, err in failed.items())


def test_no_module_imports_a_private_name_of_another():
    found = [
        f"{name}:{line} imports {imported} from {source}"
        for name in MODULES
        for source, imported, line in imports_of(name)
        if imported is not None
        and imported.startswith("_")
        and not imported.startswith("__")
        and _existing(source) != name
    ]
    assert not found, "\n".join(found)


def test_no_module_reaches_a_private_attribute_another_defines():
    """``x._name`` where ``_name`` is not the accessing module's own but another
    module of the package defines it (a method, or ``self._name = ...``): one
    module reaching into another's objects. Names the package does not define
    (torch's and TorchRec's private methods a subclass overrides, NamedTuple's
    ``_replace``) are the frameworks' and pass."""
    defined = {name: private_definitions(name) for name in MODULES}
    found = []
    for name in MODULES:
        for attr, line, text in private_accesses(name):
            if attr in defined[name]:
                continue
            owners = sorted(other for other, names in defined.items() if attr in names)
            if owners:
                found.append(f"{name}:{line} {text} ({attr} is defined in {', '.join(owners)})")
    assert not found, "\n".join(found)


def test_the_module_import_graph_has_no_cycle():
    graph = import_graph()
    found = [cycle_path(graph, c) for c in cycles(graph)]
    assert not found, "import cycles:\n" + "\n".join(found)


def test_sub_packages_depend_on_each_other_only_in_known_cycles():
    """``state_dict`` sits below the modules it describes (``ebc``, ``sharding``) and
    ``checkpoint`` above them; a new cycle between sub-packages fails, a known one
    that is gone must leave the list."""
    graph: dict[str, set[str]] = {}
    for name, targets in import_graph().items():
        graph.setdefault(sub_package(name), set()).update(
            sub_package(t) for t in targets if sub_package(t) != sub_package(name)
        )
    for node in list(graph.values()):
        for target in node:
            graph.setdefault(target, set())
    found = cycles(graph)
    report = "\n".join(cycle_path(graph, c) for c in found)
    assert found == KNOWN_PACKAGE_CYCLES, f"sub-package cycles:\n{report}"


def test_the_state_dict_package_sits_below_the_modules_it_describes():
    graph = import_graph()
    below = [name for name in MODULES if name.startswith(f"{PACKAGE}.state_dict")]
    above = (f"{PACKAGE}.ebc", f"{PACKAGE}.sharding", f"{PACKAGE}.checkpoint")
    reach: set[str] = set()
    todo = list(below)
    while todo:
        for target in graph[todo.pop()]:
            if target not in reach:
                reach.add(target)
                todo.append(target)
    wrong = sorted(t for t in reach if t.startswith(above))
    assert not wrong, f"torchrec_kvemb.state_dict reaches {wrong}"
