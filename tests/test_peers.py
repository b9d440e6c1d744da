"""`kvports bench --peers`: the llama.cpp and CTranslate2 rows, and what they say when their
packages are absent. Never timings; the suite never needs the packages."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from kvports.shared.bench.rows import agree_steps
from kvports.shared.bench.runners import PEERS_MISSING
from tests.helpers import run_cli

PEERS = [("llama.cpp", None), ("ctranslate2", "float32"), ("ctranslate2", "int8")]
ARGV = ["bench", "--new-tokens", "2", "--repeats", "1", "--frameworks", "numpy", "--modes", "cached", "--peers"]


@pytest.fixture
def peers_absent(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("llama_cpp", "ctranslate2") else real(name, *a)
    )


def test_absent_peers_get_rows_that_say_how_to_install_them(capsys, peers_absent):
    code, out, _ = run_cli(capsys, *ARGV, "--json")
    rows = json.loads(out)["rows"]
    assert code == 0
    assert [(row["framework"], row["variant"], row["available"]) for row in rows] == [("numpy", None, True)] + [
        (framework, variant, False) for framework, variant in PEERS
    ]
    assert all(row["reason"] == PEERS_MISSING and row["ttft_ms"] is None for row in rows[1:])
    assert "pip install 'kvports[peers]'" in PEERS_MISSING
    assert rows[0]["agree_steps"] == 2 and rows[1]["agree_steps"] is None


def test_absent_peers_keep_every_number_column_of_the_table(capsys, peers_absent):
    code, out, _ = run_cli(capsys, *ARGV)
    peer_lines = [line for line in out.splitlines() if line.startswith(("│ llama.cpp", "│ ctranslate2"))]
    assert code == 0 and len(peer_lines) == 3
    for line in peer_lines:
        cells = [cell.strip() for cell in line.strip("│").split("│")]
        assert cells[2:-1] == ["-"] * (len(cells) - 3)  # every number column intact, none holding text
        assert cells[-1].startswith("unavailable: not installed (pip install")
    assert "agree" in out.splitlines()[2]  # the agreement column's header


def test_agree_steps_counts_the_leading_new_tokens_equal_in_every_row():
    reference = np.array([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]])  # [B, P + N], P = 2
    assert agree_steps(reference, reference, 2) == 3
    assert agree_steps(np.array([[1, 2, 3, 9, 5], [1, 2, 3, 4, 5]]), reference, 2) == 1
    assert agree_steps(np.array([[1, 2, 3, 4, 5], [1, 2, 8, 4, 5]]), reference, 2) == 0


def test_llama_cpp_on_weights_that_are_not_gguf_says_why(capsys):
    pytest.importorskip("llama_cpp")
    code, out, _ = run_cli(capsys, *ARGV, "--json")
    row = next(row for row in json.loads(out)["rows"] if row["framework"] == "llama.cpp")
    assert code == 0 and not row["available"]
    assert row["reason"] == "ValueError: llama.cpp runs a GGUF file: give --weights FILE.gguf or --model smollm2"
