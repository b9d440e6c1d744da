"""`kvports check`: an implementation of the seed's model, in the post's interface or as an
adapter, held to the reference; each known mistake named; every unusable plug-in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvports.checker import DIAGNOSES, run_check, variants
from kvports.checker.suite import FAMILY_CONFIGS, family_weights, random_tokens
from kvports.registry import load_port
from kvports.shared.errors import UserError
from kvports.testing import check_implementation
from tests.helpers.checker import (
    ADAPTER,
    FIXTURES,
    INTERFACES,
    PORT_ADAPTER,
    check_json,
    fixture,
    variant,
    with_mistake,
)
from tests.helpers.commands import assert_one_error_line, run_cli

NAIVE_CAT = "idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)"  # generate_naive's


@pytest.mark.parametrize("interface", INTERFACES)
def test_a_correct_implementation_passes(interface):
    code, report = check_json(fixture(interface))
    assert (code, report["ok"], report["diagnoses"]) == (0, True, [])
    statuses = {check["name"]: check["status"] for check in report["checks"]}
    assert set(statuses.values()) <= {"pass", "noise", "skip"}
    for name in ("golden tokens", "full logits float32, T=512", "cached == full float32, P=504", ", batch 3"):
        assert any(name in check for check in statuses), name  # the lengths 1, 5 and the maximum, and a batch


def test_the_posts_forward_takes_its_caches_as_a_required_argument():
    # As the post writes it: forward(idx, caches), a list of None per block for the whole history.
    assert "    def forward(self, idx, caches):\n" in fixture("post").read_text()
    code, report = check_json(fixture("post"), quick=True)
    assert (code, report["diagnoses"]) == (0, [])
    assert {check["status"] for check in report["checks"] if "cached ==" in check["name"]} <= {"pass", "noise"}


@pytest.mark.parametrize("offset, status, code", [(1e-7, "noise-f32", 0), (1e-3, "FAIL", 1)])
def test_a_float64_difference_of_float32s_size_is_float32_inside_and_a_larger_one_fails(tmp_path, offset, status, code):
    # Right in float32; in float64, every logit off by `offset`, as float32 RMSNorm or RoPE tables leave it.
    full = "    return port.forward_chunks(model, tokens, [tokens.shape[1]])\n"
    shifted = full.replace("return", "logits =") + f"    return logits + {offset} * (logits.dtype == np.float64)\n"
    exit_status, report = check_json(variant(tmp_path, PORT_ADAPTER, full, shifted), "gpt2")
    (row,) = [check for check in report["checks"] if check["name"].startswith("full logits float64")]
    assert (exit_status, row["status"]) == (code, status)
    assert {check["status"] for check in report["checks"] if "float32" in check["name"]} <= {"pass", "noise"}


def test_the_post_interface_is_imported_without_running_its_main_block():
    # post_model.py's __main__ block exits; run_path(..., run_name="__main__") would run it.
    code, report = check_json(fixture("post"))
    assert code == 0 and report["interface"] == "post" and report["reference"] == "kvports torch port"


def test_float32_noise_passes_with_its_figures(capsys):
    code, out, _ = run_cli(capsys, "check", ADAPTER)
    assert code == 0 and "max |logit diff|" in out and "noise" in out
    _, report = check_json(ADAPTER)
    noisy = [check for check in report["checks"] if check["status"] == "noise"]
    assert noisy and all(0 < check["max_abs_diff"] < 1e-4 for check in noisy)
    assert report["reference"] == "kvports numpy port"


@pytest.mark.parametrize("mistake", DIAGNOSES)
@pytest.mark.parametrize("interface", INTERFACES)
def test_each_known_mistake_is_named(tmp_path, interface, mistake):
    code, report = check_json(with_mistake(tmp_path, interface, mistake))
    assert (code, report["ok"], report["diagnoses"]) == (1, False, [mistake])
    assert [check for check in report["checks"] if check["status"] == "FAIL"]
    assert [line for line in report["explanations"] if line.startswith(mistake + ": ")]  # its own line, and fix


def test_a_prefill_fed_token_by_token_returning_the_last_logits_only_is_a_prefill(tmp_path):
    # The learner's step loops over the prompt and keeps the last call's logits [B, 1, V].
    prefill = with_mistake(tmp_path, "adapter", "prefill")
    broken = variant(
        tmp_path, prefill, "return np.concatenate(pieces, axis=1), state", "return pieces[-1], state", "b.py"
    )
    code, report = check_json(broken, quick=True)
    assert (code, report["diagnoses"]) == (1, ["prefill"])
    assert {check["status"] for check in report["checks"] if "==" in check["name"]} <= {"pass", "noise"}
    assert report["notes"] and "only the last position" in report["notes"][0]


def test_a_batch_the_full_forward_takes_and_step_does_not_fails(tmp_path):
    step = "def step(model, tokens, state):\n"
    one_row = step + '    if tokens.shape[0] > 1:\n        raise ValueError("one row at a time")\n'
    code, report = check_json(variant(tmp_path, ADAPTER, step, one_row), quick=True)
    rows = {check["name"]: check["status"] for check in report["checks"]}
    assert (code, rows["full logits float32, T=16, batch 3"]) == (1, "noise")
    assert rows["cached == full float32, P=7 + 9 steps, batch 3"] == "FAIL"


def test_a_cache_attended_but_never_grown_is_a_cache_update_not_a_mask_offset(tmp_path):
    # At P=1 it is mask_offset's signature too (a decode step sees the first token only); the runs
    # of P=5 and more are not, so mask_offset reproduces only part of what fails and is not named.
    code, report = check_json(with_mistake(tmp_path, "adapter", "never_grown"), quick=True)
    assert (code, report["diagnoses"]) == (1, ["cache_update"])
    failed = [check for check in report["checks"] if check["status"] == "FAIL" and "cached ==" in check["name"]]
    assert len(failed) == 3 and {check["diagnosis"] for check in failed} == {"cache_update"}


def test_a_wrong_architecture_with_a_right_cache_passes_the_cached_rows(tmp_path):
    # The attention scale is wrong in every forward: the full rows differ from the reference, and
    # the cached rows, held to the implementation's own full forward, still pass.
    broken = variant(tmp_path, ADAPTER, "np.float32(np.sqrt(Dh))", "np.float32(Dh)")
    code, report = check_json(broken, quick=True)
    rows = {check["name"]: check["status"] for check in report["checks"]}
    assert code == 1 and report["diagnoses"] == []
    assert rows["full logits float32, T=5"] == rows["full logits float32, T=16, batch 3"] == "FAIL"
    assert {status for name, status in rows.items() if name.startswith("cached ==")} <= {"pass", "noise"}
    (line,) = report["explanations"]  # the generated tokens that part follow from it: not listed again
    assert line.startswith("architecture: ")
    assert "exact, erf" in line and "LayerNorm" in line and "RMSNorm" not in line


def test_a_cache_defect_no_mistake_reproduces_is_listed_run_by_run(tmp_path):
    # A wrong architecture and positions restarting in the cache: no broken reference reproduces
    # a run, so none is named and each failing cached run is its own line.
    broken = variant(tmp_path, with_mistake(tmp_path, "adapter", "position_offset"), "np.sqrt(Dh)", "Dh", "two.py")
    code, report = check_json(broken, quick=True)
    failed = [check["name"] for check in report["checks"] if check["status"] == "FAIL" and "cached ==" in check["name"]]
    unexplained = [line for line in report["explanations"] if line.endswith("no known mistake reproduces it")]
    assert (code, report["diagnoses"]) == (1, [])
    assert len(failed) == 3 and [line.split(":")[0] for line in unexplained] == failed


def test_the_text_says_what_json_says(capsys, tmp_path):
    broken = with_mistake(tmp_path, "adapter", "never_grown")
    code, out, _ = run_cli(capsys, "check", broken, "--quick")
    _, report = check_json(broken, quick=True)
    lines = [line.removeprefix("diagnosis: ") for line in out.splitlines() if line.startswith("diagnosis: ")]
    assert code == 1 and "FAIL" in out
    assert lines == report["explanations"] and lines[0].startswith("cache_update: ") and "append" in lines[0]


def test_a_defect_is_located_at_its_first_step(tmp_path):
    _, report = check_json(with_mistake(tmp_path, "adapter", "position_offset"))
    cached = [check for check in report["checks"] if check["name"].startswith("cached == full float32, P=5 ")]
    # The prefill is right; the first token after it, at position 5, is the first wrong one.
    assert [(c["status"], c["first_step"], c["row"], c["position"]) for c in cached] == [("FAIL", 1, 0, 5)]
    assert cached[0]["max_abs_diff"] > 0.1


def test_a_cache_concatenated_along_the_wrong_axis_is_a_cache_update(tmp_path):
    # It raises at the first cached step after the prefill: the cache, not the prompt, broke it.
    broken = variant(
        tmp_path, fixture("post"), 'k = torch.cat([cache["k"], k], dim=2)', 'k = torch.cat([cache["k"], k], dim=1)'
    )
    code, report = check_json(broken)
    assert (code, report["diagnoses"]) == (1, ["cache_update"])
    (line,) = [line for line in report["explanations"] if line.startswith("cache_update: ")]  # the text says it too
    assert "raised RuntimeError" in line


def test_the_posts_cat_without_dim_is_explained_in_one_line(capsys, tmp_path):
    broken = variant(tmp_path, fixture("post"), NAIVE_CAT, NAIVE_CAT.removesuffix(", dim=1)") + ")")
    code, out, err = run_cli(capsys, "check", broken, "--quick")
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
            "return model.forward(tokens, state)[:, :, :-1], state",
        ),
        "step returned logits of shape [1, 5, 499], expected [B, T, V] = [1, 5, 500]",
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
def test_an_unusable_plugin_is_refused_with_what_is_wrong(tmp_path, case):
    make, message = BAD_PLUGINS[case]
    with pytest.raises(UserError) as refused:
        run_check(str(make(tmp_path)))
    assert message in str(refused.value), refused.value


def test_an_unusable_plugin_is_one_error_line_from_the_command(capsys, tmp_path):
    make, message = BAD_PLUGINS["a missing function"]
    err = assert_one_error_line(*run_cli(capsys, "check", make(tmp_path)))
    assert message in err, err


@pytest.mark.parametrize("family", FAMILY_CONFIGS)
def test_an_adapter_of_each_family_passes_in_float32_and_float64(family):
    code, report = check_json(PORT_ADAPTER, family)
    assert (code, report["family"]) == (0, family)
    assert any(check["name"].startswith("cached == full float64") for check in report["checks"])


def test_the_post_interface_runs_the_seed_model_only():
    with pytest.raises(UserError, match="seed's model only"):
        run_check(str(fixture("post")), "gpt2")


def test_an_adapter_is_found_by_module_name_too(monkeypatch):
    monkeypatch.chdir(FIXTURES)  # importable from the folder the command runs in, as `python -m` finds it
    code, report = check_json("numpy_adapter")
    assert (code, report["interface"]) == (0, "adapter")


def test_a_seed_only_adapter_given_another_family_is_refused():
    with pytest.raises(UserError, match="KeyError"):  # it reads pos.weight, which a RoPE model has not
        run_check(str(ADAPTER), "llama")


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


def test_the_documented_rope_permutation_lets_interleaved_pairs_compute_the_same():
    # docs/CHECK.md: an implementation rotating pairs (2i, 2i + 1) permutes each head's q and k rows
    # with w.reshape(H, 2, Dh // 2, D).transpose(0, 2, 1, 3).reshape(H * Dh, D).
    H, Dh, D, T, theta = 4, 8, 32, 6, 10000.0
    rng = np.random.default_rng(0)
    w, x, positions = rng.normal(size=(H * Dh, D)), rng.normal(size=(T, D)), np.arange(3, 3 + T)
    heads = (x @ w.T).reshape(T, H, Dh).transpose(1, 0, 2)[None]  # [1, H, T, Dh]
    half_split = variants.rotate(heads, positions, 1 / theta ** (np.arange(Dh // 2) / (Dh // 2)))
    permuted = w.reshape(H, 2, Dh // 2, D).transpose(0, 2, 1, 3).reshape(H * Dh, D)
    pairs = (x @ permuted.T).reshape(T, H, Dh // 2, 2)  # [T, H, Dh/2, 2]: (2i, 2i + 1)
    angles = positions[:, None] / theta ** (np.arange(Dh // 2) / (Dh // 2))  # [T, Dh/2]
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]  # [T, 1, Dh/2]
    a, b = pairs[..., 0], pairs[..., 1]
    interleaved = np.stack([a * cos - b * sin, b * cos + a * sin], axis=-1)  # [T, H, Dh/2, 2]
    # Row 2i of the interleaved layout is row i of the half-split one, row 2i + 1 is row i + Dh/2.
    as_half_split = interleaved.transpose(1, 0, 3, 2).reshape(H, T, Dh)[None]  # [1, H, T, Dh]
    np.testing.assert_allclose(as_half_split, half_split, atol=1e-12)
