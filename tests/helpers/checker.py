"""`kvports check`'s tests: the implementations they check (tests/check_fixtures/), copies of
them with one mistake, and the checks' report as --json gives it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvports.checker import run_check
from tests.helpers.commands import run_cli

FIXTURES = Path(__file__).resolve().parents[1] / "check_fixtures"
POST = FIXTURES / "post_model.py"  # torch
HF_ADAPTER = FIXTURES / "hf_adapter.py"  # transformers' own classes
ADAPTER = FIXTURES / "numpy_adapter.py"
PORT_ADAPTER = FIXTURES / "port_adapter.py"
INTERFACES = {"post": POST, "adapter": ADAPTER}


def fixture(interface: str) -> Path:
    if interface == "post":
        pytest.importorskip("torch")
    return INTERFACES[interface]


def variant(tmp_path: Path, source: Path, old: str, new: str, name: str = "impl.py") -> Path:
    text = source.read_text()
    assert old in text
    path = tmp_path / name
    path.write_text(text.replace(old, new, 1))
    return path


def with_mistake(tmp_path: Path, interface: str, mistake: str) -> Path:
    return variant(tmp_path, fixture(interface), "MISTAKE = None", f"MISTAKE = {mistake!r}")


def check_json(target, family: str = "seed", quick: bool = False) -> tuple[int, dict]:
    """The checks in this process (the command runs the same ones in a child process,
    tests/checker/test_isolation.py holds it to them): the command's exit status for the
    report, and --json's object."""
    report = run_check(str(target), family, quick).as_dict()
    return (0 if report["ok"] else 1), report


def command_json(capsys, *argv) -> tuple[int, dict]:
    code, out, err = run_cli(capsys, "check", *argv, "--json")
    assert code in (0, 1), err
    return code, json.loads(out)
