"""The packages' import graph: the floors ``tlm`` <- ``tlm_io`` <- ``tlm_train`` <- ``tlm_convert`` <- ``tlm_study`` <- ``tlm_cli``
(each package imports only the packages before it), no import cycles (module level and inside functions alike), no
project import inside a function, and no module importing another module's underscore names.
``python tests/test_imports.py`` prints the graph."""

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tlm", "tlm_io", "tlm_train", "tlm_convert", "tlm_study", "tlm_cli")  # the floors, bottom first
# ``python -m tlm_convert`` / ``torchrun -m tlm_train`` are entry points that only start the CLI floor above their
# package; nothing imports a __main__ module, so it adds no arrow that another module could follow back down.
ENTRY_POINTS = ("__main__",)
# the only project imports that wait inside a function: the console entry points check the sizes their inputs declare
# before importing the commands; tlm --help lists the commands without importing tlm_cli.main (torch and
# transformers: seconds); tlm-convert checks every option and path before importing the conversion
DEFERRED = {"tlm_cli/launch.py": {"tlm_cli.convert", "tlm_cli.group"}, "tlm_cli/group.py": {"tlm_cli.main"},
            "tlm_cli/convert.py": {"tlm_convert.convert", "tlm_convert.evalsets", "tlm_convert.accuracy"}}
# third-party libraries slow to import, imported inside the functions that use them: off every command's import path
SLOW_LIBRARIES = ("sklearn",)


def _imports(file: Path):
    """(imported module, [names], inside a function) for every import statement of ``file``."""
    tree = ast.parse(file.read_text(encoding="utf-8"))
    here = file.parent.relative_to(ROOT).parts  # the package a relative import starts from
    nested = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
              for node in ast.walk(fn)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ((node.module,) if node.module else ()))
            else:
                base = node.module
            yield base, [a.name for a in node.names], id(node) in nested
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], id(node) in nested


def _files(package: str):
    """Every module of ``package``, its subpackages' (tlm_io/templates/) included."""
    return sorted((ROOT / package).rglob("*.py"))


def _module(file: Path) -> str:
    return ".".join(file.relative_to(ROOT).with_suffix("").parts)


def import_graph() -> dict[str, list[str]]:
    """module -> the modules of PACKAGES it imports."""
    graph = {}
    for package in PACKAGES:
        for file in _files(package):
            deps = set()
            for base, names, _ in _imports(file):
                for name in names or [None]:
                    target = f"{base}.{name}" if name else base
                    deps.add(target if (ROOT / (target.replace(".", "/") + ".py")).is_file() else base)
            module = _module(file)
            graph[module] = sorted(d for d in deps if d.split(".")[0] in PACKAGES and d != module)
    return graph


def test_every_package_is_a_floor():
    """A new tlm* package must take its place in PACKAGES (and so in the checks below)."""
    assert {p.parent.name for p in ROOT.glob("tlm*/__init__.py")} == set(PACKAGES)


def test_imports_point_down_the_floors():
    floor = {package: i for i, package in enumerate(PACKAGES)}
    against = [f"{module} -> {dep}" for module, deps in import_graph().items() for dep in deps
               if module.rsplit(".", 1)[1] not in ENTRY_POINTS
               and floor[dep.split(".")[0]] > floor[module.split(".")[0]]]
    assert against == [], "imports against the floor order " + " < ".join(PACKAGES)


def test_no_project_import_inside_a_function():
    """An import inside a function hides an arrow from this graph (it was how an arrow against the order hid)."""
    found = [f"{file.relative_to(ROOT)}: {base}" for package in PACKAGES for file in _files(package)
             for base, _, nested in _imports(file) if nested and base.split(".")[0] in PACKAGES
             and base not in DEFERRED.get(file.relative_to(ROOT).as_posix(), ())]
    assert found == []


def test_slow_libraries_are_imported_where_they_are_used():
    found = [f"{file.relative_to(ROOT)}: {base}" for package in PACKAGES for file in _files(package)
             for base, _, nested in _imports(file) if not nested and base.split(".")[0] in SLOW_LIBRARIES]
    assert found == []


def test_no_module_imports_underscore_names():
    found = [f"{file.relative_to(ROOT)}: {base} import {name}"
             for package in PACKAGES + ("bench",) for file in _files(package)
             for base, names, _ in _imports(file) for name in names
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
    test_imports_point_down_the_floors()
    print("no import cycles; every import points down the floors " + " <- ".join(PACKAGES))
