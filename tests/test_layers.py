"""The package's layers, written once here, and the rules every import in it keeps:

* a module imports only from its own layer or lower ones (lazy imports inside functions count);
* two layers of the same rank (analysis, train) do not import each other;
* no module imports another module's private name (`from m import _x`, or `m._x` on an
  imported module);
* the import graph between modules has no cycle.

The walk reads the source (ast), so it sees every import, run or not.
"""
import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "specbench"

# Lowest first. A layer is a subpackage, or (the base) the package's own small modules; layers
# in one tuple share a rank. The package's __init__ / __main__ are its front door, above all.
LAYERS = [
    ("base",),
    ("engine",),
    ("drafters",),
    ("costs",),
    ("policies",),
    ("bench",),
    ("analysis", "train"),
    ("cli",),
]
BASE_MODULES = {"specbench.errors", "specbench.atomic", "specbench.resources"}
FRONT_DOOR = {"specbench", "specbench.__main__"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def layer_of(module: str) -> str:
    if module in FRONT_DOOR:
        return "front door"
    if module in BASE_MODULES:
        return "base"
    parts = module.split(".")
    if len(parts) >= 2 and any(parts[1] in layer for layer in LAYERS):
        return parts[1]
    raise AssertionError(f"{module} is in no layer: add it to LAYERS / BASE_MODULES in {__file__}")


def rank(layer: str) -> int:
    if layer == "front door":
        return len(LAYERS)
    return next(i for i, names in enumerate(LAYERS) if layer in names)


def resolve(name: str) -> str | None:
    """The package module `name` denotes (a module, or a package's __init__), else None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str):
    """(line, imported module, imported name or None) for every import in `module`, plus
    (line, module, attribute) for `alias._private` uses of an imported package module."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("specbench"):
                    yield node.lineno, resolve(a.name), None
                    if a.asname:
                        aliases[a.asname] = resolve(a.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("specbench"):
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in MODULES:  # `from specbench.cli import train`: a module
                    yield node.lineno, full, None
                    aliases[a.asname or a.name] = full
                else:
                    yield node.lineno, resolve(base), a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            yield node.lineno, aliases[node.value.id], node.attr


def test_every_module_is_in_a_layer():
    for module in MODULES:
        layer_of(module)


def test_imports_point_down_and_never_at_private_names():
    problems = []
    for module in MODULES:
        here = layer_of(module)
        for line, target, name in imports(module):
            where = f"{MODULES[module].relative_to(PACKAGE_DIR.parent)}:{line}"
            there = layer_of(target)
            if target != module and rank(there) > rank(here):
                problems.append(f"{where}: {module} ({here}) imports {target} ({there}), a higher layer")
            elif rank(there) == rank(here) and there != here:
                problems.append(f"{where}: {module} ({here}) imports {target} ({there}), a sibling layer")
            if name and name.startswith("_") and not name.startswith("__") and target != module:
                problems.append(f"{where}: {module} uses {target}'s private name {name}")
    assert not problems, "\n".join(problems)


def test_no_import_cycles():
    graph = {m: {t for _, t, _ in imports(m) if t != m and t not in FRONT_DOOR and not _is_ancestor(t, m)}
             for m in MODULES}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(cycles)


def _is_ancestor(package: str, module: str) -> bool:
    """Importing `specbench.x.y` runs `specbench.x`'s __init__: not an edge of the graph."""
    return module.startswith(package + ".")


def test_the_walk_sees_lazy_upward_and_private_imports(tmp_path, monkeypatch):
    """Negative control: a module with a lazy upward import and a private-name use is caught."""
    bad = PACKAGE_DIR / "engine" / "_layer_probe.py"
    source = ("def f():\n    from specbench.analysis import report\n    return report._png_b64\n\n"
              "def g():\n    from specbench.bench.runner import _trace\n")
    monkeypatch.setitem(MODULES, "specbench.engine._layer_probe", bad)
    monkeypatch.setattr(Path, "read_text", _read_with(bad, source))
    found = [(t, n) for _, t, n in imports("specbench.engine._layer_probe")]
    assert ("specbench.analysis.report", None) in found
    assert ("specbench.analysis.report", "_png_b64") in found
    assert ("specbench.bench.runner", "_trace") in found
    try:
        test_imports_point_down_and_never_at_private_names()
    except AssertionError as e:
        message = str(e)
    else:
        raise AssertionError("the layer walk missed an upward import")
    assert "a higher layer" in message and "private name _png_b64" in message and "private name _trace" in message


def _read_with(path: Path, source: str):
    original = Path.read_text

    def read_text(self, *a, **k):
        return source if self == path else original(self, *a, **k)

    return read_text


def test_test_modules_do_not_import_each_other():
    """Shared test code lives in helper modules (tests/helpers.py, tiny.py, ...), not in test_*.py."""
    tests_dir = Path(__file__).resolve().parent
    test_modules = {p.stem for p in tests_dir.glob("test_*.py")}
    problems = []
    for path in sorted(tests_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            problems += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in test_modules]
    assert not problems, "\n".join(problems)
