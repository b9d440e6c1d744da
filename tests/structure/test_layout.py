"""Where things are: a file name answers "where is X". No two modules share a name unless they
mirror each other across the ports (the same path in torch_impl/, jax_impl/ and numpy_impl/)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PORTS = ("torch_impl", "jax_impl", "numpy_impl")
FOLDERS = ("kvports", "shared", *PORTS)


def modules_by_name(folders: tuple[str, ...] = FOLDERS) -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = defaultdict(list)
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name != "__init__.py":
                found[path.name].append(path.relative_to(ROOT))
    return found


def mirrored(paths: list[Path]) -> bool:
    """Every path is one port's copy of the same file (torch_impl/fast/quant.py, jax_impl/fast/quant.py)."""
    return all(path.parts[0] in PORTS for path in paths) and len({path.parts[1:] for path in paths}) == 1


def collisions() -> dict[str, list[str]]:
    return {
        name: [str(p) for p in paths]
        for name, paths in modules_by_name().items()
        if len(paths) > 1 and not mirrored(paths)
    }


def test_no_two_modules_share_a_file_name_unless_they_mirror_each_other_across_the_ports():
    assert collisions() == {}


def test_a_port_file_beside_a_same_named_application_or_shared_file_is_a_collision():
    assert not mirrored([Path("shared/quant.py"), Path("torch_impl/fast/quant.py")])
    assert not mirrored([Path("torch_impl/quant.py"), Path("jax_impl/fast/quant.py")])  # mirrors sit at the same path
    assert mirrored([Path("torch_impl/fast/quant.py"), Path("jax_impl/fast/quant.py")])


def listed_modules(package: Path) -> list[str]:
    """The modules a package docstring's list names: each `- name` or `- name.py` item (before its
    colon; several may share one, `- errors, files:`)."""
    import ast
    import re

    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    names = []
    for line in docstring.splitlines():
        head = line[2 : line.index(":")] if line.startswith("- ") and ":" in line else ""
        if re.fullmatch(r"`?\w+(\.py)?`?(, `?\w+(\.py)?`?)*", head):  # a list of names, not prose
            names += [name.strip("`").removesuffix(".py") for name in head.split(", ")]
    return names


def missing_listed_modules(root: Path) -> dict[str, list[str]]:
    """Each package whose docstring lists a module that is neither `name.py` nor `name/` beside it."""
    missing = {}
    for init in sorted(root.rglob("__init__.py")):
        package = init.parent
        absent = [
            name
            for name in listed_modules(package)
            if not (package / f"{name}.py").is_file() and not (package / name).is_dir()
        ]
        if absent:
            missing[str(package.relative_to(root))] = absent
    return missing


def test_every_module_a_package_docstring_lists_exists():
    assert {folder: missing_listed_modules(ROOT / folder) for folder in (*FOLDERS, "tests")} == dict.fromkeys(
        (*FOLDERS, "tests"), {}
    )


def test_a_package_docstring_listing_a_renamed_module_is_caught(tmp_path):
    (tmp_path / "package").mkdir()
    (tmp_path / "package" / "kept.py").write_text("")
    (tmp_path / "package" / "__init__.py").write_text('"""Modules:\n- `kept`: here\n- `gone`, `kept`: renamed\n"""\n')
    assert missing_listed_modules(tmp_path) == {"package": ["gone"]}
