"""The packages' import graph: no module imports another module's underscore names, and no import cycles (module
level and inside functions alike). ``python tests/test_imports.py`` prints the graph."""

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tlm", "tlm_convert", "tlm_train")


def _imports(file: Path, package: str):
    """(imported module, [names]) for every import statement of ``file``."""
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = package + ("." + node.module if node.module else "") if node.level else node.module
            yield base, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []


def import_graph() -> dict[str, list[str]]:
    """module -> the modules of PACKAGES it imports."""
    graph = {}
    for package in PACKAGES:
        for file in sorted((ROOT / package).glob("*.py")):
            deps = set()
            for base, names in _imports(file, package):
                for name in names or [None]:
                    target = f"{base}.{name}" if name else base
                    deps.add(target if (ROOT / (target.replace(".", "/") + ".py")).is_file() else base)
            module = f"{package}.{file.stem}"
            graph[module] = sorted(d for d in deps if d.split(".")[0] in PACKAGES and d != module)
    return graph


def test_no_module_imports_underscore_names():
    found = [f"{file.relative_to(ROOT)}: {base} import {name}"
             for package in PACKAGES + ("bench",) for file in sorted((ROOT / package).glob("*.py"))
             for base, names in _imports(file, package) for name in names
             if name.startswith("_") and not name.startswith("__")]
    assert found == []


def test_no_import_cycles():
    try:
        list(TopologicalSorter(import_graph()).static_order())
    except CycleError as err:  # pragma: no cover - the failure message
        raise AssertionError(f"import cycle: {' -> '.join(err.args[1])}") from None


if __name__ == "__main__":
    for module, deps in import_graph().items():
        print(f"{module} -> {', '.join(deps)}")
    test_no_import_cycles()
    print("no import cycles")
