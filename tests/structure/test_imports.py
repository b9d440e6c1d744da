"""The import structure, read from the sources (AST): no cycle among kvports' modules; shared/
(what the ports share) imports nothing of the application and no framework but NumPy; a port
imports shared and itself, never the application (kvports/) or another port."""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The repository's folders and the names they install under (pyproject's package-dir).
FOLDERS = {
    "kvports": "kvports",
    "shared": "kvports.shared",
    "torch_impl": "kvports.torch_impl",
    "jax_impl": "kvports.jax_impl",
    "numpy_impl": "kvports.numpy_impl",
}
PORTS = ("kvports.torch_impl", "kvports.jax_impl", "kvports.numpy_impl")
FRAMEWORKS = {"torch", "jax", "jaxlib", "flax"}
LAZY_ONLY = {"transformers", "tokenizers", "matplotlib", "gguf", "jinja2"}  # shared may use these inside functions only


@dataclass
class Module:
    name: str
    path: Path
    imports: set[str] = field(default_factory=set)  # kvports modules, by import statement
    loads: set[str] = field(default_factory=set)  # kvports modules named in a string (importlib)
    external_at_import: set[str] = field(default_factory=set)  # top-level names of other packages, module level
    external_lazy: set[str] = field(default_factory=set)  # ... inside functions


def module_name(folder: str, path: Path) -> str:
    parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([FOLDERS[folder], *parts])


def is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def read_modules() -> dict[str, Module]:
    paths = {module_name(folder, path): path for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))}
    modules = {name: Module(name, path) for name, path in paths.items()}
    for module in modules.values():
        package = module.name if module.path.name == "__init__.py" else module.name.rsplit(".", 1)[0]
        visit(ast.parse(module.path.read_text()), module, package, set(modules), lazy=False)
    return modules


def visit(node: ast.AST, module: Module, package: str, known: set[str], lazy: bool) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and is_type_checking(child):
            continue  # never runs
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            for target in imported(child, package, known):
                record(module, target, lazy)
        elif isinstance(child, ast.Constant) and isinstance(child.value, str) and child.value in known:
            # A bare "kvports" is the program's name in text (argparse's prog), never a module loaded by name.
            if "." in child.value:
                module.loads.add(child.value)
        visit(
            child,
            module,
            package,
            known,
            lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)),
        )


def imported(node: ast.stmt, package: str, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    # `from kvports import registry` imports a module; `from kvports.registry import PORTS` a name.
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]


def record(module: Module, target: str, lazy: bool) -> None:
    if target == "kvports" or target.startswith("kvports."):
        module.imports.add(target)
    elif not is_stdlib(target):
        (module.external_lazy if lazy else module.external_at_import).add(target.split(".")[0])


def is_stdlib(name: str) -> bool:
    return name.split(".")[0] in sys.stdlib_module_names or name == "__future__"


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state:
                found = walk(target)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = walk(node)
            if found:
                return found
    return None


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


MODULES = read_modules()
# The application's subpackages (kvports.bench, kvports.commands, ...), and what the ports share.
PACKAGES = {name for name, module in MODULES.items() if module.path.name == "__init__.py" and name.count(".") == 1}
SHARED = {name for name in MODULES if within(name, "kvports.shared")}


def edges(module: Module, dynamic: bool = False) -> set[str]:
    return module.imports | (module.loads if dynamic else set())


# ---------------------------------------------------------------- the rules


def test_kvports_modules_import_each_other_without_a_cycle():
    # Loads by name (importlib) count too: the bench loading a port that imports the bench is a cycle.
    graph = {name: edges(module, dynamic=True) for name, module in MODULES.items()}
    assert find_cycle(graph) is None


def package_of(name: str) -> str:
    """A module of a subpackage of the application (kvports.bench.rows, kvports.formats.gguf.reader)
    as that subpackage (kvports.bench, kvports.formats); any other module as itself."""
    parts = name.split(".")
    if len(parts) > 2 and f"{parts[0]}.{parts[1]}" in PACKAGES:
        return ".".join(parts[:2])
    return name


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, module in MODULES.items():
        node = package_of(name)
        graph.setdefault(node, set()).update(
            package_of(target) for target in edges(module, dynamic=True) if package_of(target) != node
        )
    return graph


def test_application_subpackages_import_each_other_without_a_cycle():
    # bench importing commands while commands import bench is a cycle even where no two files import each other.
    assert find_cycle(package_graph()) is None


def test_a_cycle_between_packages_is_found_where_no_two_files_form_one():
    graph = {package_of(a): {package_of(b)} for a, b in (("kvports.bench.x", "kvports.commands.y"),)}
    graph[package_of("kvports.commands.z")] = {package_of("kvports.bench.w")}
    assert find_cycle(graph) == ["kvports.bench", "kvports.commands", "kvports.bench"]


@pytest.mark.parametrize("name", sorted(SHARED))
def test_shared_imports_nothing_of_the_application(name):
    assert sorted(edges(MODULES[name], dynamic=True) - SHARED) == []


def test_the_package_root_loads_its_api_only_on_first_use():
    code = "import sys, kvports.shared.config\nprint('kvports.api' in sys.modules, kvports.load.__module__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert (result.returncode, result.stdout.split()) == (0, ["False", "kvports.api"]), result.stderr


@pytest.mark.parametrize("port", PORTS)
def test_a_port_imports_only_shared_and_itself(port):
    found = {target for module in MODULES.values() if within(module.name, port) for target in edges(module)}
    assert sorted(target for target in found if target not in SHARED and not within(target, port)) == []


def test_baselines_import_no_command_and_no_bench():
    found = {
        target for module in MODULES.values() if within(module.name, "kvports.baselines") for target in edges(module)
    }
    tools = ("kvports.cli", "kvports.commands", "kvports.bench")
    assert sorted(target for target in found if any(within(target, tool) for tool in tools)) == []


@pytest.mark.parametrize("name", sorted(SHARED))
def test_shared_imports_no_framework_and_heavy_libraries_only_inside_functions(name):
    module = MODULES[name]
    assert sorted((module.external_at_import | module.external_lazy) & FRAMEWORKS) == []
    assert sorted(module.external_at_import & LAZY_ONLY) == []


def test_importing_all_of_shared_loads_no_framework():
    """The AST rules above, as Python sees them: every module of shared imported, no framework loaded."""
    shared = [name for name in MODULES if within(name, "kvports.shared")]
    code = (
        f"import importlib, sys\nfor name in {shared!r}: importlib.import_module(name)\n"
        f"print(sorted(set(sys.modules) & set({sorted(FRAMEWORKS | LAZY_ONLY)!r})))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert (result.returncode, result.stdout.strip()) == (0, "[]"), result.stderr


# ---------------------------------------------------------------- the readers themselves


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_reader_sees_static_lazy_and_by_name_imports():
    registry = MODULES["kvports.registry"]
    assert "kvports.numpy_impl.port" in registry.loads  # importlib.import_module(MODULES[name])
    assert "kvports.shared.contract" in registry.imports
    assert "matplotlib" in MODULES["kvports.bench.plots"].external_lazy
    assert "kvports.commands.compare" in MODULES["kvports.cli"].imports  # from ... import compare
    assert "torch" in MODULES["kvports.torch_impl.port"].external_at_import
