"""The package's shape: imports run one way through declared layers, no circles, no module over 600 lines.

Imports are read from the source (``ast``), deferred ones inside functions
included: a function-level import that goes the wrong way is still a wrong
arrow, only one that fails later. Nothing is imported here.

``LAYERS`` is the package's floor plan, bottom first (docs/architecture.md
draws it): a module may import modules of its own group and of any lower
layer; an import up a layer or across to another group of the same layer
fails the test, and so does a module in no group.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "nnsight_ray"
MAX_LINES = 600

#: Bottom first. A group is a module or a package (all modules under it); the root
#: group ``nnsight_ray``, and a package written with a trailing ``=``, is that package's ``__init__`` only.
LAYERS: list[list[str]] = [
    ["nnsight_ray.errors", "nnsight_ray._internal"],
    ["nnsight_ray._internal.observe", "nnsight_ray._internal.cluster"],
    ["nnsight_ray._internal.blocks", "nnsight_ray._internal.merge"],
    ["nnsight_ray._internal.pipeline", "nnsight_ray._internal.extract"],
    ["nnsight_ray._internal.ranks"],
    ["nnsight_ray._internal.engine"],
    ["nnsight_ray._internal.deploy"],
    ["nnsight_ray.models", "nnsight_ray.refs"],
    ["nnsight_ray.local"],
    ["nnsight_ray.streaming"],
    ["nnsight_ray.ray_vllm"],
    ["nnsight_ray.batch", "nnsight_ray.serve"],
    ["nnsight_ray.data"],
    # The batch CLI builds nnsight_ray.data's processor: its pipeline and entry point sit above data, which
    # itself uses the batch config, preflight and intervention loading below it.
    ["nnsight_ray.batch.pipeline"],
    # The batch package's face (``from nnsight_ray.batch import run_batch``) re-exports the pipeline's entry.
    ["nnsight_ray.batch.__main__", "nnsight_ray.batch="],
    ["nnsight_ray.demo", "nnsight_ray.compare_layouts"],
    ["nnsight_ray.cli"],
    ["nnsight_ray"],
]


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    found = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def parse(path: Path) -> ast.AST:
    """``ast.parse``, again once on CPython 3.11's "AST constructor recursion depth mismatch".

    That ``SystemError`` is CPython's (python/cpython#106905, fixed after 3.11.7): the AST converter's
    recursion counter is the interpreter's, not the call's, and the suite's process has Ray's and vLLM's
    threads running (it failed this test once in a full run, at before=126, after=74).
    """
    source = path.read_text()
    try:
        return ast.parse(source)
    except SystemError as error:
        if "recursion depth mismatch" not in str(error):
            raise
        return ast.parse(source)


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports (``from .x import y`` counts ``.x.y`` when that is a module)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                found.add(sub if sub in known else module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in known and m != name}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def group_of(module: str, layers: list[list[str]]) -> tuple[str, int] | None:
    """The declared group a module belongs to (the longest that contains it) and its layer."""
    best = None
    for level, groups in enumerate(layers):
        for group in groups:
            alone = "." not in group or group.endswith("=")  # the package's ``__init__`` only
            name = group.rstrip("=")
            if module == name or (not alone and module.startswith(name + ".")):
                if best is None or len(group) > len(best[0]):
                    best = (group, level)
    return best


def wrong_arrows(graph: dict[str, set[str]], layers: list[list[str]]) -> list[str]:
    """Every import that runs up a layer or across groups of one layer, and every module in no group."""
    found = []
    for module in sorted(graph):
        here = group_of(module, layers)
        if here is None:
            found.append(f"{module} is in no layer: add it to LAYERS in tests/unit/test_structure.py")
            continue
        for target in sorted(graph[module]):
            there = group_of(target, layers)
            if there is None or there[0] == here[0]:
                continue
            if there[1] > here[1]:
                found.append(f"{module} -> {target}: up from layer {here[1]} ({here[0]}) to {there[1]} ({there[0]})")
            elif there[1] == here[1]:
                found.append(f"{module} -> {target}: across layer {here[1]} ({here[0]} -> {there[0]})")
    return found


def test_imports_run_down_the_declared_layers():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    wrong = wrong_arrows(graph, LAYERS)
    assert not wrong, "imports against the layers (docs/architecture.md):\n" + "\n".join(wrong)


def test_a_synthetic_tree_with_an_upward_and_a_crossing_import_fails(tmp_path):
    package = tmp_path / "pkg"
    files = {
        "__init__.py": "",
        "errors.py": "",
        "low/__init__.py": "",
        "low/a.py": "from ..errors import X\nfrom . import b\n",
        "low/b.py": "def f():\n    from ..high import top  # deferred, still an arrow\n",
        "side/__init__.py": "",
        "side/c.py": "from ..low.a import Y\n",
        "mid/__init__.py": "",
        "mid/d.py": "import pkg.side.c\nfrom pkg.low import a\n",
        "high/__init__.py": "",
        "high/top.py": "from ..mid import d\n",
        "stray.py": "",
    }
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    layers = [["pkg.errors"], ["pkg.low", "pkg.mid"], ["pkg.side"], ["pkg.high"], ["pkg"]]
    known = modules(package)
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert graph["pkg.low.a"] == {"pkg.errors", "pkg.low.b"}
    assert wrong_arrows(graph, layers) == [
        "pkg.low.b -> pkg.high.top: up from layer 1 (pkg.low) to 3 (pkg.high)",
        "pkg.mid.d -> pkg.low.a: across layer 1 (pkg.mid -> pkg.low)",
        "pkg.mid.d -> pkg.side.c: up from layer 1 (pkg.mid) to 2 (pkg.side)",
        "pkg.stray is in no layer: add it to LAYERS in tests/unit/test_structure.py",
    ]
    layers[1] = ["pkg.low", "pkg.mid", "pkg.side"]
    assert "pkg.side.c -> pkg.low.a: across layer 1 (pkg.side -> pkg.low)" in wrong_arrows(graph, layers)


def test_no_module_imports_one_that_imports_it_back():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert sum(map(len, graph.values())) > 50, "the import reader found almost nothing"
    found = circles(graph)
    assert not found, "import circles: " + "; ".join(
        " <-> ".join(c) + " (" + ", ".join(f"{a} -> {b}" for a in c for b in sorted(graph[a]) if b in c) + ")"
        for c in found)


def test_the_circle_finder_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines (split by role, docs/architecture.md): {long}"
