"""`kvports check`: an implementation of the seed's model, in the post's interface or as an
adapter, held to the reference; each known mistake named; every unusable plug-in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvports.checker import DIAGNOSES, variants
from kvports.checker.suite import FAMILY_CONFIGS, family_weights, random_tokens
from kvports.registry import load_port
from kvports.shared.errors import UserError
from kvports.testing import check_implementation
from tests.helpers.commands import assert_one_error_line, run_cli

FIXTURES = Path(__file__).parent / "check_fixtures"
POST = FIXTURES / "post_model.py"  # torch
ADAPTER = FIXTURES / "numpy_adapter.py"
PORT_ADAPTER = FIXTURES / "port_adapter.py"
INTERFACES = {"post": POST, "adapter": ADAPTER}
NAIVE_CAT = "idx = torch.cat([idx, nxt], dim=1)"  # generate_naive's, the first of the file's two


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


def check_json(capsys, *argv) -> tuple[int, dict]:
    code, out, err = run_cli(capsys, "check", *argv, "--json")
    assert code in (0, 1), err
    return code, json.loads(out)


@pytest.mark.parametrize("interface", INTERFACES)
def test_a_correct_implementation_passes(capsys, interface):
    code, report = check_json(capsys, fixture(interface))
    assert (code, report["ok"], report["diagnoses"]) == (0, True, [])
    statuses = {check["name"]: check["status"] for check in report["checks"]}
    assert set(statuses.values()) <= {"pass", "noise", "skip"}
    for name in ("golden tokens", "full logits float32, T=512", "cached == full float32, P=504", ", batch 3"):
        assert any(name in check for check in statuses), name  # the lengths 1, 5 and the maximum, and a batch


def test_the_post_interface_is_imported_without_running_its_main_block(capsys):
    # post_model.py's __main__ block exits; run_path(..., run_name="__main__") would run it.
    code, report = check_json(capsys, fixture("post"))
    assert code == 0 and report["interface"] == "post" and report["reference"] == "kvports torch port"


def test_float32_noise_passes_with_its_figures(capsys):
    code, out, _ = run_cli(capsys, "check", ADAPTER)
    assert code == 0 and "max |logit diff|" in out and "noise" in out
    _, report = check_json(capsys, ADAPTER)
    noisy = [check for check in report["checks"] if check["status"] == "noise"]
    assert noisy and all(0 < check["max_abs_diff"] < 1e-4 for check in noisy)
    assert report["reference"] == "kvports numpy port"


@pytest.mark.parametrize("mistake", DIAGNOSES)
@pytest.mark.parametrize("interface", INTERFACES)
def test_each_known_mistake_is_named(capsys, tmp_path, interface, mistake):
    code, report = check_json(capsys, with_mistake(tmp_path, interface, mistake))
    assert (code, report["ok"], report["diagnoses"]) == (1, False, [mistake])
    assert [check for check in report["checks"] if check["status"] == "FAIL"]


def test_the_table_gives_one_diagnosis_line_per_mistake(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "check", with_mistake(tmp_path, "adapter", "cache_update"))
    assert code == 1 and "FAIL" in out
    lines = [line for line in out.splitlines() if line.startswith("diagnosis: ")]
    assert len(lines) == 1 and lines[0].startswith("diagnosis: cache_update: ") and "write" in lines[0]


def test_a_defect_is_located_at_its_first_step(capsys, tmp_path):
    _, report = check_json(capsys, with_mistake(tmp_path, "adapter", "position_offset"))
    cached = [check for check in report["checks"] if check["name"].startswith("cached == full float32, P=5 ")]
    # The prefill is right; the first token after it, at position 5, is the first wrong one.
    assert [(c["status"], c["first_step"], c["row"], c["position"]) for c in cached] == [("FAIL", 1, 0, 5)]
    assert cached[0]["max_abs_diff"] > 0.1


def test_a_cache_concatenated_along_the_wrong_axis_is_a_cache_update(capsys, tmp_path):
    # It raises at the first cached step after the prefill: the cache, not the prompt, broke it.
    broken = variant(
        tmp_path, fixture("post"), 'k = torch.cat([cache["k"], k], dim=2)', 'k = torch.cat([cache["k"], k], dim=1)'
    )
    code, report = check_json(capsys, broken)
    assert (code, report["diagnoses"]) == (1, ["cache_update"])


def test_the_posts_cat_without_dim_is_explained_in_one_line(capsys, tmp_path):
    broken = variant(tmp_path, fixture("post"), NAIVE_CAT, "idx = torch.cat([idx, nxt])")
    code, out, err = run_cli(capsys, "check", broken)
    assert code == 1 and "Traceback" not in out + err
    lines = [line for line in out.splitlines() if line.startswith("diagnosis: ")]
    assert len(lines) == 1
    assert "generate_naive raised RuntimeError" in lines[0] and "dim=1" in lines[0]


BAD_PLUGINS = {
    "no such file": (lambda tmp: tmp / "missing.py", "does not exist"),
    "a syntax error": (lambda tmp: write(tmp, "def load(:\n"), "line 1"),
    "a missing function": (lambda tmp: write(tmp, "def load(c, w): pass\ndef full(m, t): pass\n"), "no function step"),
    "wrong parameter names": (
        lambda tmp: variant(tmp, fixture("post"), "self.head =", "self.lm_head ="),
        "missing ['head.weight'], unexpected ['lm_head.weight']",
    ),
    "wrong output shapes": (
        lambda tmp: variant(
            tmp, ADAPTER, "return model.forward(tokens, None)", "return model.forward(tokens, None)[:, -1]"
        ),
        "full returned logits of shape [1, 500], expected [B, T, V] = [1, 5, 500]",
    ),
    "wrong step output shapes": (
        lambda tmp: variant(
            tmp,
            ADAPTER,
            "return model.forward(tokens, state), state",
            "return model.forward(tokens, state)[:, -1:], state",
        ),
        "step returned logits of shape [1, 1, 500], expected [B, T, V] = [1, 5, 500]",
    ),
    "NaN logits": (
        lambda tmp: variant(
            tmp, ADAPTER, "return model.forward(tokens, None)", "return model.forward(tokens, None) * np.nan"
        ),
        "full returned non-finite logits",
    ),
}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "plugin.py"
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", BAD_PLUGINS)
def test_an_unusable_plugin_is_one_error_line(capsys, tmp_path, case):
    make, message = BAD_PLUGINS[case]
    err = assert_one_error_line(*run_cli(capsys, "check", make(tmp_path)))
    assert message in err, err


@pytest.mark.parametrize("family", FAMILY_CONFIGS)
def test_an_adapter_of_each_family_passes_in_float32_and_float64(capsys, family):
    code, report = check_json(capsys, PORT_ADAPTER, "--family", family)
    assert (code, report["family"]) == (0, family)
    assert any(check["name"].startswith("cached == full float64") for check in report["checks"])


def test_the_post_interface_runs_the_seed_model_only(capsys):
    err = assert_one_error_line(*run_cli(capsys, "check", fixture("post"), "--family", "gpt2"))
    assert "seed's model only" in err


def test_an_adapter_is_found_by_module_name_too(capsys, monkeypatch):
    monkeypatch.chdir(FIXTURES)  # importable from the folder the command runs in, as `python -m` finds it
    code, report = check_json(capsys, "numpy_adapter")
    assert (code, report["interface"]) == (0, "adapter")


def test_a_seed_only_adapter_given_another_family_is_refused(capsys):
    err = assert_one_error_line(*run_cli(capsys, "check", ADAPTER, "--family", "llama"))
    assert "llama" in err or "KeyError" in err


@pytest.mark.parametrize("family", ["seed", *FAMILY_CONFIGS])
def test_the_broken_reference_without_a_mistake_is_the_numpy_port(family):
    config, weights = family_weights(family)
    tokens = random_tokens(config, 2, 12, 0)
    port = load_port("numpy")
    expected = port.forward_chunks(port.load_model(config, weights, "float64"), tokens, [12])
    for chunks in ([12], [5, *[1] * 7]):
        np.testing.assert_allclose(variants.forward_chunks(config, weights, tokens, chunks), expected, atol=1e-12)
    for mistake in variants.MISTAKES:  # each mistake changes the cached logits: its signature is visible
        broken = variants.forward_chunks(config, weights, tokens, [5, *[1] * 7], mistake)
        assert np.abs(broken - expected).max() > 1e-2, mistake


def test_check_implementation_returns_the_report_or_raises_with_the_diagnosis(tmp_path):
    assert check_implementation(str(ADAPTER)).ok
    with pytest.raises(AssertionError, match="mask_offset"):
        check_implementation(str(with_mistake(tmp_path, "adapter", "mask_offset")))
    with pytest.raises(UserError, match="does not exist"):
        check_implementation(str(tmp_path / "nothing.py"))


def test_help_names_the_interfaces_and_the_tensor_names(capsys):
    with pytest.raises(SystemExit):
        run_cli(capsys, "check", "--help")
    out = capsys.readouterr().out
    for phrase in ("generate_cached(model, prompt, n)", "step(model, tokens [B, T], state)", "blocks.{i}.qkv", "exit"):
        assert phrase in out.lower() or phrase in out, phrase
