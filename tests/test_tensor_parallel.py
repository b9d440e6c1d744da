"""Tensor parallelism, JAX's side and the shared checks: N devices give one device's tokens and
logits (float64: the same tokens, the logits to the last bits an all-reduce's order changes),
and every bad N is one `error:` line, the same for every port. (torch: test_tensor_parallel_torch.py.)

JAX's simulated CPU devices exist only in a process that asked for them before JAX started, so
the runs happen once, in a subprocess with 4 devices (`tests.helpers.parallel.tensor_parallel_subprocess`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import kvports
from kvports.shared.checks import API, COMMAND_LINE
from kvports.validation import check_tensor_parallel
from tests.helpers.agreement import assert_logits_close, assert_tokens_agree
from tests.helpers.commands import assert_one_error_line, run_cli
from tests.helpers.models import GOLDEN, TINY_FAMILIES, llama_like
from tests.helpers.parallel import COLLECTIVES, TP_CASES, tensor_parallel_subprocess
from tests.helpers.ports import port_or_skip

FLOAT64_LOGITS = 1e-12  # an all-reduce sums the partial products in another order than one product
FLOAT32_LOGITS = 1e-5


@pytest.fixture(scope="module")
def all_runs(tmp_path_factory):
    """Both dtypes' runs, from one subprocess: float64's every case, float32's greedy one, and the
    collectives of the split forward's compiled program."""
    port_or_skip("jax")
    port_or_skip("torch")  # the tiny models' weights come from the reference initialisation
    cases = {"float64": tuple(TP_CASES), "float32": ("cached_greedy",)}
    return tensor_parallel_subprocess(tmp_path_factory.mktemp("tp") / "runs", cases)


@pytest.fixture(scope="module")
def runs(all_runs):
    return all_runs["float64"]


@pytest.mark.slow  # one subprocess compiling 3 families x 3 cases x 3 sizes (and float32's greedy case)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", list(TP_CASES))
@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_jax_split_across_n_devices_gives_one_devices_tokens_and_logits(runs, family, case, n):
    one, split = f"{family}/{case}/1", f"{family}/{case}/{n}"
    np.testing.assert_array_equal(runs[f"{split}/tokens"], runs[f"{one}/tokens"])
    if f"{one}/logits" in runs:
        np.testing.assert_allclose(runs[f"{split}/logits"], runs[f"{one}/logits"], atol=FLOAT64_LOGITS, rtol=0)


@pytest.fixture(scope="module")
def runs_float32(all_runs):
    return all_runs["float32"]


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_jax_split_in_float32_agrees_with_one_device_up_to_near_ties(runs_float32, family, n):
    one, split = f"{family}/cached_greedy/1", f"{family}/cached_greedy/{n}"
    reference_logits = runs_float32[f"{one}/logits"]
    agreement = assert_tokens_agree(runs_float32[f"{one}/tokens"], reference_logits, runs_float32[f"{split}/tokens"], 4)
    assert_logits_close(reference_logits, runs_float32[f"{split}/logits"], FLOAT32_LOGITS, agreement, f"{family} {n}")


@pytest.mark.slow
@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_jax_splits_qkv_by_output_and_the_kv_cache_by_key_value_heads(runs, family):
    # llama at N = 4 has 2 key/value heads: each copied to 2 devices, so the cache still splits by heads
    for n in (2, 4):
        assert str(runs[f"{family}/{n}/qkv_spec"]) == "(None, 'model')"
        assert str(runs[f"{family}/{n}/cache_spec"]) == "(None, None, 'model')"
    assert str(runs[f"{family}/1/cache_spec"]) == "()"


@pytest.fixture(scope="module")
def collectives(all_runs):
    return all_runs["collectives"]


@pytest.mark.slow  # the same subprocess
@pytest.mark.parametrize("T", [5, 1], ids=["prefill", "decode"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_jax_split_forward_compiles_to_two_all_reduces_a_layer_and_no_other_collective(collectives, family, n, T):
    # The fused kernels are stored shard-major and regrouped after the product (fast/parallel.py): XLA
    # keeps each device on its own columns. Read in their natural order instead, q, k and v would each
    # move between devices (collective-permutes).
    found = {name: int(collectives[f"{family}/{n}/{T}/{name}"]) for name in COLLECTIVES}
    expected = dict.fromkeys(COLLECTIVES, 0) | {"all-reduce": 2 * TINY_FAMILIES[family].n_layers}
    assert found == expected


# ---------------------------------------------------------------- bad values: one line, every port

BAD = {
    "zero": (0, "--tensor-parallel 0 is below 1", "tensor_parallel=0 is below 1"),
    "above_the_bound": (65, "--tensor-parallel 65 is above 64", "tensor_parallel=65 is above 64"),
    "divides_nothing": (
        3,
        "--tensor-parallel 3 must divide the model's query heads (n_heads 4) and its FFN width (ffn_dim 512)",
        "tensor_parallel=3 must divide the model's query heads (n_heads 4) and its FFN width (ffn_dim 512)",
    ),
}
GENERATE = ["generate", "--mode", "cached", "--new-tokens", "2"]


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("bad", list(BAD))
def test_a_bad_tensor_parallel_is_one_error_line_before_any_port_loads(capsys, no_port_may_load, bad, framework):
    n, message, _ = BAD[bad]
    err = assert_one_error_line(*run_cli(capsys, *GENERATE, "--framework", framework, "--tensor-parallel", n))
    assert err.startswith(f"error: {message}")


@pytest.mark.parametrize("bad", list(BAD))
def test_the_api_names_its_own_tensor_parallel_argument(no_port_may_load, bad):
    n, _, message = BAD[bad]
    with pytest.raises(kvports.UserError, match=f"^{message}".replace("(", r"\(").replace(")", r"\)")):
        kvports.load("jax", tensor_parallel=n)


def test_numpy_refuses_tensor_parallelism_in_one_line(capsys, no_port_may_load):
    err = assert_one_error_line(*run_cli(capsys, *GENERATE, "--framework", "numpy", "--tensor-parallel", "2"))
    assert err == "error: numpy has no tensor parallelism; --tensor-parallel 2 needs torch or jax\n"
    with pytest.raises(kvports.UserError, match="^numpy has no tensor parallelism; tensor_parallel=2 needs"):
        kvports.load("numpy", tensor_parallel=2)


def test_more_devices_than_jax_started_with_is_one_error_line(capsys):
    jax = pytest.importorskip("jax")
    count = len(jax.devices("cpu"))  # this process's JAX has started: its device count is fixed
    err = assert_one_error_line(
        *run_cli(capsys, *GENERATE, "--framework", "jax", "--tensor-parallel", 2 * count if count > 1 else 2)
    )
    assert err.startswith(f"error: --tensor-parallel {2 * count if count > 1 else 2} is above the {count} cpu devices")


@pytest.mark.parametrize(
    "n, heads, kv_heads, ffn, refused",
    [
        (2, 4, 1, 64, None),  # MQA: its one key/value head copied to both devices
        (4, 8, 2, 64, None),  # GQA: 2 heads, each on 2 devices
        (2, 6, 3, 64, "must divide one another"),  # 3 key/value heads on 2 devices: neither split nor copied
        (2, 4, 2, 30, None),
        (4, 4, 2, 30, "FFN width (ffn_dim 30)"),
        (8, 4, 4, 64, "query heads (n_heads 4)"),
    ],
)
def test_tensor_parallel_needs_whole_heads_and_ffn_slices(n, heads, kv_heads, ffn, refused):
    config = llama_like(vocab_size=16, d_model=8 * heads, n_heads=heads, n_kv_heads=kv_heads, ffn_hidden=ffn)
    if refused is None:
        assert check_tensor_parallel(n, "jax", [("the model", config)], COMMAND_LINE) == n
        return
    for names in (COMMAND_LINE, API):
        with pytest.raises(kvports.UserError, match=refused.replace("(", r"\(").replace(")", r"\)")):
            check_tensor_parallel(n, "torch", [("the model", config)], names)


def test_torch_batch_refuses_tensor_parallelism_in_one_line(capsys, no_port_may_load, tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"prompt": [1, 2, 3], "max_tokens": 2}\n')
    err = assert_one_error_line(
        *run_cli(capsys, "batch", "--framework", "torch", "--requests", requests, "--tensor-parallel", "2")
    )
    assert err == "error: --tensor-parallel 2 in batch runs on jax only: torch's ranks have no paged cache\n"


@pytest.mark.parametrize("command", ["generate", "compare", "bench", "batch"])
def test_every_run_command_takes_tensor_parallel_and_refuses_zero_in_one_line(capsys, no_port_may_load, command):
    err = assert_one_error_line(*run_cli(capsys, command, "--tensor-parallel", "0"))
    assert err == "error: --tensor-parallel 0 is below 1\n"


def test_tensor_parallel_one_is_todays_generate(capsys):
    argv = ["generate", "--framework", "numpy", "--mode", "cached", "--new-tokens", "8", "--json"]
    code, out, _ = run_cli(capsys, *argv, "--tensor-parallel", "1")
    output = json.loads(out)
    assert (code, output["tensor_parallel"], output["tokens"][0][5:]) == (0, 1, GOLDEN[:8])
