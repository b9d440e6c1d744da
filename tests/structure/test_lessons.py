"""What each port's lesson files promise the reader, read from their sources (AST): model.py is the
model and its cache alone (nothing in it exists for speed, quantization or tensor parallelism: that
is fast/'s, applied to a loaded model from outside); model.py and generate.py stay short enough to
read top to bottom; and the three ports' model.py, sampling.py and generate.py define the same
names in the same order, apart from the few differences a framework forces, listed here with why."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PORTS = ("torch_impl", "jax_impl", "numpy_impl")
LESSONS = ("model.py", "sampling.py", "generate.py")
MAX_LINES = {"model.py": 340, "sampling.py": 320, "generate.py": 320}
# What only makes a model faster, smaller or split across devices: fast/'s business, never the lesson's.
OUTSIDE = re.compile(r"shards|quant|parallel|onednn", re.IGNORECASE)

# name -> why, for each name one port's lesson has and the reference's has not (+), or lacks (-).
COMPILED = "what JAX's loops compile: jit over the model's (static, leaves), the cache or state donated"
FORCED = {
    "jax_impl": {
        "model.py": {
            "-KVCache.filled": "shapes are static under jit: the keys always span every slot",
            "+KVCache.write": "an immutable cache: one scatter into the whole buffer returns a new cache",
        },
        "generate.py": {
            "+_forward": COMPILED,
            "+_start_cached": COMPILED,
            "+_decode_one_token": COMPILED,
            "+_decode_n_tokens": COMPILED,
        },
    },
}


def source(port: str, file: str) -> str:
    return (ROOT / port / file).read_text()


def imported_modules(tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found += [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def defined_names(tree: ast.Module) -> list[str]:
    """Top-level functions, classes and assignments, and each class's methods and fields as
    `Class.name`, in file order. An nnx module's `__call__` is torch's `forward` (flax calls it so)."""

    def assigned(node: ast.stmt) -> list[str]:
        if isinstance(node, ast.Assign):
            return [target.id for target in node.targets if isinstance(target, ast.Name)]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            return [node.target.id]
        return []

    names = []
    for node in tree.body:
        names += assigned(node)
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.append(node.name)
        if isinstance(node, ast.ClassDef):
            for inner in node.body:
                members = [inner.name] if isinstance(inner, ast.FunctionDef) else assigned(inner)
                names += [f"{node.name}.{'forward' if member == '__call__' else member}" for member in members]
    return names


@pytest.mark.parametrize("port", PORTS)
def test_a_model_imports_nothing_that_changes_it_from_outside(port):
    imports = imported_modules(ast.parse(source(port, "model.py")))
    assert [name for name in imports if ".fast" in name or OUTSIDE.search(name)] == []


@pytest.mark.parametrize("file", LESSONS)
@pytest.mark.parametrize("port", PORTS)
def test_no_lesson_line_exists_for_speed_quantization_or_tensor_parallelism(port, file):
    lines = source(port, file).splitlines()
    assert [f"{number}: {line}" for number, line in enumerate(lines, 1) if OUTSIDE.search(line)] == []


@pytest.mark.parametrize("file", LESSONS)
@pytest.mark.parametrize("port", PORTS)
def test_a_lesson_reads_top_to_bottom_in_a_few_hundred_lines(port, file):
    assert len(source(port, file).splitlines()) <= MAX_LINES[file]


@pytest.mark.parametrize("file", LESSONS)
@pytest.mark.parametrize("port", PORTS[1:])
def test_each_port_defines_the_references_names_in_its_order(port, file):
    forced = FORCED.get(port, {}).get(file, {})
    missing = {name[1:] for name in forced if name.startswith("-")}
    extra = {name[1:] for name in forced if name.startswith("+")}
    reference = [name for name in defined_names(ast.parse(source("torch_impl", file))) if name not in missing]
    ours = defined_names(ast.parse(source(port, file)))
    assert missing <= set(defined_names(ast.parse(source("torch_impl", file)))) and extra <= set(ours), "stale FORCED"
    assert [name for name in ours if name not in extra] == reference


def test_the_name_reader_sees_functions_classes_methods_and_fields():
    tree = ast.parse("A = 1\nclass C:\n    x: int\n    def __call__(self): ...\n    def m(self): ...\ndef f(): ...\n")
    assert defined_names(tree) == ["A", "C", "C.x", "C.forward", "C.m", "f"]
