"""`kvports compare`: every path agreeing on the golden tokens or exit 1, an uninstalled framework
skipped, the first installed port as reference without torch, only the frameworks and modes
asked for, speculative rows held to cached, a title that counts what ran. (Its logit figures and
table width: test_compare_figures.py.)"""

from __future__ import annotations

import importlib.metadata
import json
import re

import pytest

from kvports import registry
from tests.helpers.commands import run_cli
from tests.helpers.models import GOLDEN
from tests.helpers.ports import port_or_skip


def test_compare_reports_every_path_agreeing_on_the_golden_tokens(capsys):
    for name in registry.PORTS:
        port_or_skip(name)
    # 20 tokens, not the demo's 100: every port's 100 golden tokens are test_generation's.
    code, out, _ = run_cli(capsys, "compare", "--json", "--new-tokens", "20")
    result = json.loads(out)
    assert code == 0 and result["ok"]
    assert result["tokens"] == [[160, 248, 104, 209, 394] + GOLDEN[:20]]
    assert len(result["rows"]) == 6 and all(row["agree"] for row in result["rows"])
    assert all(row["cached_speedup"] > 0 for row in result["rows"] if row["mode"] == "cached")


def test_compare_exits_1_when_a_path_disagrees(capsys, monkeypatch):
    torch_port = port_or_skip("torch")

    class Broken:
        NAME = "numpy"

        def __getattr__(self, name):
            return getattr(torch_port, name)

        @staticmethod
        def generate(model, prompts, new_tokens, mode, return_logits=False, *, on_token=None):
            tokens, logits = torch_port.generate(model, prompts, new_tokens, mode, return_logits, on_token=on_token)
            tokens = tokens.copy()
            tokens[:, -1] = (tokens[:, -1] + 1) % 500  # a real bug: the last token is wrong
            return tokens, logits

    real = registry.available_port
    monkeypatch.setattr(
        registry,
        "available_port",
        lambda name: Broken() if name == "numpy" else (None if name == "jax" else real(name)),
    )
    code, out, _ = run_cli(capsys, "compare", "--json", "--new-tokens", "10")
    result = json.loads(out)
    assert code == 1 and not result["ok"]
    broken = [row for row in result["rows"] if row["framework"] == "numpy"]
    assert all(row["first_divergent_step"] == 9 and not row["explained"] for row in broken)


def test_compare_skips_an_uninstalled_framework_and_still_agrees(capsys, monkeypatch):
    real = registry.available_port
    monkeypatch.setattr(registry, "available_port", lambda name: None if name == "jax" else real(name))
    code, out, _ = run_cli(capsys, "compare", "--json", "--new-tokens", "10")
    result = json.loads(out)
    assert code == 0 and result["ok"]
    assert [row["available"] for row in result["rows"] if row["framework"] == "jax"] == [False, False]


def test_compare_without_torch_takes_the_first_installed_port_as_reference(capsys, monkeypatch):
    real = registry.available_port
    monkeypatch.setattr(registry, "available_port", lambda name: real(name) if name == "numpy" else None)
    code, out, _ = run_cli(capsys, "compare", "--json", "--new-tokens", "5")
    result = json.loads(out)
    assert code == 0 and result["ok"] and result["reference"] == "numpy naive"
    assert [(row["framework"], row["available"]) for row in result["rows"]] == [
        ("numpy", True),
        ("numpy", True),
        ("torch", False),
        ("torch", False),
        ("jax", False),
        ("jax", False),
    ]


def test_compare_table_says_not_installed(capsys, monkeypatch):
    real = registry.available_port
    monkeypatch.setattr(registry, "available_port", lambda name: real(name) if name == "numpy" else None)
    code, out, _ = run_cli(capsys, "compare", "--new-tokens", "5")
    assert code == 0 and "reference: numpy naive" in " ".join(out.split())  # the title wraps
    assert re.findall(r"(\w+)\W+(naive|cached)\W+not installed", out) == [
        ("torch", "naive"),
        ("torch", "cached"),
        ("jax", "naive"),
        ("jax", "cached"),
    ]


def test_compare_table_says_a_framework_older_than_its_port_needs_is_unavailable_and_why(capsys, monkeypatch):
    port_or_skip("jax")
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.12.0" if name == "flax" else real(name))
    monkeypatch.setattr(registry, "_loaded", {})
    code, out, _ = run_cli(capsys, "compare", "--new-tokens", "3", "--frameworks", "jax,numpy", "--repeats", "1")
    assert code == 0
    assert re.findall(r"(\w+)\W+(naive|cached)\W+unavailable", out) == [("jax", "naive"), ("jax", "cached")]
    assert "jax: flax 0.12.0 is older than 0.12.1" in " ".join(out.split())  # the footnote wraps


# --- --frameworks, --modes and speculative rows ---------------------------------------------------


def compare_json(capsys, *argv: str) -> dict:
    code, out, err = run_cli(capsys, "compare", "--json", "--repeats", "1", "--new-tokens", "6", *argv)
    assert code == 0, err
    return json.loads(out)


def test_compare_runs_only_the_frameworks_and_modes_asked(capsys):
    result = compare_json(capsys, "--frameworks", "numpy", "--modes", "cached")
    assert [(row["framework"], row["mode"]) for row in result["rows"]] == [("numpy", "cached")]
    assert result["reference"] == "numpy cached"


def test_compare_speculative_rows_are_held_to_cached_with_their_acceptance(capsys):
    result = compare_json(capsys, "--frameworks", "numpy", "--modes", "cached,speculative", "--draft", "ngram")
    cached, speculative = result["rows"]
    assert speculative["agree"] and speculative["mode"] == "speculative"
    assert speculative["speculative_speedup"] == pytest.approx(cached["seconds"] / speculative["seconds"])
    assert 0 <= speculative["speculative"]["acceptance_rate"] <= 1
    code, out, err = run_cli(capsys, "compare", "--frameworks", "numpy", "--draft", "ngram", "--repeats", "1")
    assert code == 0, err
    assert "draft kept: the draft's proposals the target accepted" in " ".join(out.split())


def test_compare_title_counts_ragged_prompts_and_one_run(capsys):
    argv = ["compare", "--frameworks", "numpy", "--repeats", "1", "--prompt", "1,2,3", "--prompt", "4,5,6,7,8"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    words = " ".join(out.split())
    assert "2 prompts of 3-5 tokens" in words
    assert "median of 1 run of" in words
