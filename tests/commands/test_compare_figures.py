"""`kvports compare`'s figures: how close each port's logits are to the reference's, with and
without teacher forcing, on a model built here; its table's width; a divergence at a near-tie."""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest

from kvports import cli, registry
from kvports.agreement import NEAR_TIE, comparable_steps, logit_difference, top2_margin
from kvports.formats.weights import load_weights, save_weights
from kvports.shared.generation import PAD, as_generation
from tests.helpers.commands import run_cli
from tests.helpers.models import SEED_PROMPT, TINY_FAMILIES, random_weights
from tests.helpers.ports import port_or_skip

NEW_TOKENS = 12
BUILT = TINY_FAMILIES["llama"]  # RoPE, RMSNorm, SwiGLU, GQA: the ports' least trivial path
LOGIT_BOUND = {"float64": 1e-12, "float32": 1e-4}


def compare_json(*argv: object) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # module-scoped fixtures have no capsys
        code = cli.main(["compare", "--json", "--repeats", "1", *map(str, argv)])
    result = json.loads(out.getvalue())
    assert code == (0 if result["ok"] else 1)
    return result


@pytest.fixture(scope="module")
def built_weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("built") / "llama.safetensors"
    save_weights(path, random_weights(BUILT, seed=11), BUILT)
    return path


@pytest.fixture(scope="module", params=["float64", "float32"])
def compared(request, built_weights):
    """One compare run per dtype, free-running and teacher-forced, on the built model."""
    common = ["--weights", built_weights, "--prompt", "1,2,3,4", "--prompt", "5,6", "--new-tokens", NEW_TOKENS]
    free = compare_json(*common, "--dtype", request.param)
    forced = compare_json(*common, "--dtype", request.param, "--teacher-forced")
    return request.param, free, forced


def row_of(result: dict, framework: str, mode: str) -> dict:
    row = next(row for row in result["rows"] if (row["framework"], row["mode"]) == (framework, mode))
    if not row["available"]:
        pytest.skip(f"{framework} is not installed")
    return row


@pytest.mark.parametrize("mode", ["naive", "cached"])
@pytest.mark.parametrize("framework", registry.PORTS)
def test_logits_are_within_the_dtypes_bound_of_the_reference(compared, framework, mode):
    dtype, free, _ = compared
    row = row_of(free, framework, mode)
    logits = row["logits"]
    assert logits["max_abs_diff"] < LOGIT_BOUND[dtype]
    assert 0 <= logits["mean_abs_diff"] <= logits["max_abs_diff"]
    assert 0 <= logits["peak_step"] < NEW_TOKENS and logits["peak_row"] in (0, 1)
    if dtype == "float64":
        assert row["agree"] and logits["steps_compared"] == 2 * NEW_TOKENS  # both rows, every step


@pytest.mark.parametrize("mode", ["naive", "cached"])
@pytest.mark.parametrize("framework", registry.PORTS)
def test_teacher_forced_logits_cover_every_step_within_the_dtypes_bound(compared, framework, mode):
    dtype, _, forced = compared
    logits = row_of(forced, framework, mode)["logits"]
    assert forced["teacher_forced"] and logits["teacher_forced"]
    assert logits["steps_compared"] == 2 * NEW_TOKENS
    assert logits["max_abs_diff"] < LOGIT_BOUND[dtype]


def test_the_reference_row_differs_from_itself_by_nothing(compared):
    _, free, forced = compared
    for result in (free, forced):
        assert row_of(result, "torch", "naive")["logits"]["max_abs_diff"] == 0.0


def test_every_row_carries_its_timings(compared):
    _, free, _ = compared
    for row in (row for row in free["rows"] if row["available"]):
        assert row["seconds"] > 0 and len(row["repeat_seconds"]) == 1
        assert (row["compile_seconds"] is not None) == (row["framework"] in registry.COMPILES)


# ---------------------------------------------------------------- a divergence at a near-tie


class TieBrokenTheOtherWay:
    """The NumPy port, except that at one step it takes the reference's second choice: what a
    framework does whose float noise breaks an exact tie the other way. Its forward_chunks (and
    so its teacher-forced logits) are NumPy's own."""

    NAME = "numpy"

    def __init__(self, port, step: int, token: int):
        self.port, self.step, self.token = port, step, token

    def __getattr__(self, name):
        return getattr(self.port, name)

    def generate(self, model, prompts, generation, mode, return_logits=False, prefill=True, on_token=None):
        tokens, logits = self.port.generate(model, prompts, generation, mode, return_logits=True)
        P, k = prompts.shape[1], self.step
        history = np.concatenate([prompts, tokens[:, P : P + k], [[self.token]]], axis=1)  # [1, P + k + 1]
        rest = as_generation(generation).max_new_tokens - k - 1
        tokens, rest_logits = self.port.generate(model, history, rest, mode, return_logits=True)
        logits = np.concatenate([logits[:, : k + 1], rest_logits], axis=1)  # [1, N, V]
        return tokens, logits if return_logits else None


def test_teacher_forcing_compares_the_logits_past_a_near_tie(tmp_path, capsys, monkeypatch, seed_weights):
    reference = port_or_skip("torch")
    numpy_port = port_or_skip("numpy")
    config, tensors = seed_weights
    tensors = dict(tensors)
    tensors["head.weight"] = tensors["head.weight"].copy()
    tensors["head.weight"][0] = tensors["head.weight"][371]  # token 0 ties with 371, the golden step 5's token
    path = tmp_path / "tied.safetensors"
    save_weights(path, tensors, config)
    tokens, logits = reference.generate(
        reference.load_model(*load_weights(path)), SEED_PROMPT, NEW_TOKENS, "naive", return_logits=True
    )
    margins = [top2_margin(logits[0, step]) for step in range(NEW_TOKENS)]
    tie = next(step for step, margin in enumerate(margins) if margin < NEAR_TIE / 100)
    chosen = int(tokens[0, 5 + tie])
    second = int(np.argsort(logits[0, tie])[-2]) if chosen == int(np.argmax(logits[0, tie])) else 0
    assert tie < NEW_TOKENS - 2 and {chosen, second} == {0, 371}
    flipped = TieBrokenTheOtherWay(numpy_port, tie, second)
    real = registry.available_port
    monkeypatch.setattr(
        registry, "available_port", lambda name: flipped if name == "numpy" else None if name == "jax" else real(name)
    )
    argv = ["compare", "--json", "--weights", path, "--new-tokens", NEW_TOKENS, "--repeats", "1"]
    free = json.loads(run_cli(capsys, *argv)[1])
    forced = json.loads(run_cli(capsys, *argv, "--teacher-forced")[1])
    for result in (free, forced):
        row = row_of(result, "numpy", "naive")
        assert result["ok"] and not row["agree"] and row["explained"] and row["first_divergent_step"] == tie
    assert row_of(free, "numpy", "naive")["logits"]["steps_compared"] == tie + 1  # up to the divergence
    forced_logits = row_of(forced, "numpy", "naive")["logits"]
    assert forced_logits["steps_compared"] == NEW_TOKENS and forced_logits["max_abs_diff"] < 1e-4  # past it


# ---------------------------------------------------------------- the pieces


def test_comparable_steps_stop_at_each_rows_own_divergence_and_at_a_stop():
    reference = np.array([[9, 1, 2, 3, 4], [9, 5, 6, PAD, PAD]])  # prompt 1; row 1 stopped after two tokens
    tokens = np.array([[9, 1, 7, 8, 4], [9, 5, 6, PAD, PAD]])  # row 0 parts at step 1
    assert comparable_steps(reference, tokens, 1).tolist() == [
        [True, True, False, False],
        [True, True, False, False],
    ]


def test_logit_difference_reports_the_peak_and_the_mean_over_compared_steps_only():
    reference = np.zeros((1, 3, 2))
    logits = np.array([[[0.1, 0.0], [0.0, -0.4], [9.0, 9.0]]])  # step 2 is not compared
    difference = logit_difference(reference, logits, np.array([[True, True, False]]), False)
    assert (difference.max_abs_diff, difference.peak_step, difference.steps_compared) == (0.4, 1, 2)
    assert difference.mean_abs_diff == pytest.approx(0.125)


# ---------------------------------------------------------------- the table


def test_the_table_fits_an_80_column_terminal(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run_cli(capsys, "compare", "--new-tokens", "5", "--repeats", "1")
    assert code == 0 and max(len(line) for line in out.splitlines()) <= 80
    assert "max" in out and "|diff|" in out  # the logit columns


def test_the_table_with_speculative_rows_fits_100_columns(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run_cli(capsys, "compare", "--new-tokens", "5", "--repeats", "1", "--draft", "ngram")
    assert code == 0 and max(len(line) for line in out.splitlines()) <= 100
