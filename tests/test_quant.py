"""Fewer bits: --dtype bfloat16, --quant int8 and --quant q4 run where a port offers them
(kvports.validation.PRECISIONS), cost what compare reports against the float32 path on the same
weights, leave float64 alone, and are refused in one line, the same for every port without them."""

from __future__ import annotations

import json

import numpy as np
import pytest

import kvports
from kvports.formats.weights import GGUFWeights
from kvports.shared.generation import GenerationConfig
from kvports.shared.quantization import float_tensors, q4_names
from kvports.validation import PRECISIONS
from tests.helpers.agreement import assert_logits_close, assert_tokens_agree, assert_within_format_distance
from tests.helpers.commands import assert_one_error_line, run_cli
from tests.helpers.gguf_files import write_gguf
from tests.helpers.models import TINY_FAMILIES, random_prompts, random_weights
from tests.helpers.ports import port_or_skip

NEW_TOKENS = 12
GREEDY = GenerationConfig(NEW_TOKENS, 0.0, 0, 1.0, 0, ())
MODES = {"bfloat16": ("bfloat16", "none"), "int8": ("float32", "int8")}


def offers(port, precision: str) -> bool:
    return precision in PRECISIONS[port.NAME]


def step_logits(port, config, tensors, dtype: str, quant: str, prompts: np.ndarray):
    model = port.load_model(config, tensors, dtype, quant=quant)
    return port.generate(model, prompts, GREEDY, "cached", return_logits=True)  # tokens [B, P + N], logits


@pytest.mark.parametrize("family", ["gpt2", "llama"])  # biases and a tied head; GQA and RMSNorm
@pytest.mark.parametrize("mode", sorted(MODES))
def test_reduced_precision_tokens_agree_with_float32_up_to_the_measured_difference(port, mode, family):
    if not offers(port, mode):
        pytest.skip(f"{port.NAME} offers no {mode}")
    config = TINY_FAMILIES[family]
    tensors = random_weights(config)
    prompts = random_prompts(config.vocab_size, 2, 6)  # [2, 6]
    tokens32, logits32 = step_logits(port, config, tensors, "float32", "none", prompts)
    tokens, logits = step_logits(port, config, tensors, *MODES[mode], prompts)
    assert logits.dtype == np.float32  # bfloat16's logits reach NumPy as float32
    assert not np.array_equal(logits, logits32)  # the format rounds something: not float32 run twice
    assert_within_format_distance(tokens32, logits32, tokens, logits, prompts.shape[1], *MODES[mode], mode)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4_blocks_are_the_files_own_weights(tmp_path, qtype):
    path = write_gguf(tmp_path / "tiny.gguf", qtype, tokenizer=False)
    with GGUFWeights(path) as weights:
        tensors = weights.read("float32", "q4")
    codes, scales, mins = (tensors[name] for name in q4_names("blocks.0.qkv.weight"))
    assert codes.dtype == np.uint8 and codes.max() <= 15
    rows, width = codes.shape
    blocks = codes.reshape(rows, width // 32, 32) * scales[..., None] + mins[..., None]  # [out, in / 32, 32]
    np.testing.assert_array_equal(blocks.reshape(rows, width), tensors["blocks.0.qkv.weight"])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4_tokens_equal_the_dequantized_path(port, tmp_path, qtype):
    if not offers(port, "q4"):
        pytest.skip(f"{port.NAME} offers no q4")
    path = write_gguf(tmp_path / "tiny.gguf", qtype, tokenizer=False)
    with GGUFWeights(path) as weights:
        config, tensors = weights.config, weights.read("float32", "q4")
    prompts = random_prompts(config.vocab_size, 1, 6)  # [1, 6]
    tokens32, logits32 = step_logits(port, config, float_tensors(tensors), "float32", "none", prompts)
    tokens, logits = step_logits(port, config, tensors, "float32", "q4", prompts)
    agreement = assert_tokens_agree(tokens32, logits32, tokens, prompts.shape[1], f"{port.NAME} {qtype}")
    # The same weights, summed in another order: float32 noise, not a rounding of the weights
    assert_logits_close(logits32, logits, 1e-4 * np.abs(logits32).max(), agreement, f"{port.NAME} {qtype}")


@pytest.mark.parametrize("quant", ["int8", "q4"])
def test_a_quantized_model_gives_the_same_logits_in_every_port_that_offers_it(tmp_path, quant):
    # The same codes and scales everywhere (shared.quantization): only the order of the float32 sums differs.
    offered = [port_or_skip(name) for name, precisions in PRECISIONS.items() if quant in precisions]
    if len(offered) < 2:
        pytest.skip(f"{quant}: fewer than two ports offer it")
    path = write_gguf(tmp_path / "tiny.gguf", "Q4_1", tokenizer=False)
    with GGUFWeights(path) as weights:
        config, tensors = weights.config, weights.read("float32", "q4")
    if quant == "int8":
        tensors = float_tensors(tensors)
    prompts = random_prompts(config.vocab_size, 2, 6)  # [2, 6]
    reference, *others = offered
    tokens0, logits0 = step_logits(reference, config, tensors, "float32", quant, prompts)
    for port in others:
        label = f"{port.NAME} {quant} against {reference.NAME} {quant}"
        tokens, logits = step_logits(port, config, tensors, "float32", quant, prompts)
        agreement = assert_tokens_agree(tokens0, logits0, tokens, prompts.shape[1], label)
        assert_logits_close(logits0, logits, 1e-4 * np.abs(logits0).max(), agreement, label)


def test_torch_int8_rows_of_a_prompt_equal_the_kernel_row_by_row():
    """At float32 several rows (a prompt) go through the dequantized weight, one row through the
    int8 kernel: the two routes give the same product."""
    torch = pytest.importorskip("torch")
    from kvports.torch_impl.fast.quant import Int8Linear

    rng = np.random.default_rng(0)
    linear = Int8Linear(rng.standard_normal((48, 32)).astype(np.float32), None)
    x = torch.from_numpy(rng.standard_normal((2, 5, 32)).astype(np.float32))  # [B, T, in]
    rows = torch.stack([torch.cat([linear(x[b, t : t + 1]) for t in range(5)]) for b in range(2)])  # [B, T, out]
    np.testing.assert_allclose(linear(x).numpy(), rows.numpy(), rtol=1e-5, atol=1e-5)


def test_torch_q4_at_float32_equals_the_kernels_product():
    """float32 goes through the 4-bit weight dequantized from our own nibbles; the kernel reads its
    packed copy: the same weight, rows padded to the kernel's 16 included (40 rows here)."""
    torch = pytest.importorskip("torch")
    from kvports.torch_impl.fast.quant import Int4Linear

    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (40, 64)).astype(np.uint8)  # [out, in]
    scales = (0.1 * rng.random((40, 2))).astype(np.float32)  # [out, in / 32]
    mins = -rng.random((40, 2)).astype(np.float32)
    linear = Int4Linear(codes, scales, mins, None)
    x = torch.from_numpy(rng.standard_normal((2, 3, 64)).astype(np.float32))  # [B, T, in]
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(6, 64), linear.packed, 32, linear.scales_and_zeros)
    np.testing.assert_allclose(linear(x).numpy().reshape(6, 40), kernel[:, :40].numpy(), rtol=1e-5, atol=1e-5)


def test_float64_is_unaffected(port):
    config = TINY_FAMILIES["llama"]  # RMSNorm: the norm that now accumulates in float32 or wider
    tensors = random_weights(config)
    prompts = random_prompts(config.vocab_size, 1, 6)
    numpy = port_or_skip("numpy")
    expected = step_logits(numpy, config, tensors, "float64", "none", prompts)
    tokens, logits = step_logits(port, config, tensors, "float64", "none", prompts)
    np.testing.assert_array_equal(tokens, expected[0])
    assert logits.dtype == np.float64
    np.testing.assert_allclose(logits, expected[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("flags", [["--dtype", "bfloat16"], ["--quant", "int8"], ["--quant", "q4"]])
def test_a_port_without_the_mode_refuses_it_in_one_line_the_same_for_every_port(
    capsys, tmp_path, no_port_may_load, flags
):
    path = write_gguf(tmp_path / "tiny.gguf", "Q4_1", tokenizer=False)
    wanted = flags[1]
    lines = set()
    for framework in PRECISIONS:
        if wanted in PRECISIONS[framework]:
            continue
        argv = ["generate", "--framework", framework, "--mode", "cached", "--weights", path, "--prompt", "1,2"]
        lines.add(assert_one_error_line(*run_cli(capsys, *argv, *flags)))
    assert len(lines) == 1, lines
    assert f"{' '.join(flags)} is offered by " in lines.pop()


@pytest.mark.parametrize("quant", ["int8", "q4"])
def test_quant_over_float64_is_refused(capsys, no_port_may_load, quant):
    argv = ["generate", "--framework", "torch", "--mode", "cached", "--dtype", "float64", "--quant", quant]
    line = assert_one_error_line(*run_cli(capsys, *argv))
    assert f"--quant {quant} needs float32 or bfloat16" in line and "--dtype float64" in line


def test_q4_without_4_bit_blocks_is_refused(capsys):
    # The seed's safetensors file holds float32 only
    line = assert_one_error_line(
        *run_cli(capsys, "generate", "--framework", "torch", "--mode", "cached", "--quant", "q4")
    )
    assert "--quant q4 needs a GGUF file with Q4_0 or Q4_1" in line


def test_the_api_names_its_own_argument():
    with pytest.raises(kvports.UserError, match=r"dtype='bfloat16' is offered by torch"):
        kvports.load("numpy", dtype="bfloat16")
    with pytest.raises(kvports.UserError, match=r"quant='int8' needs float32 or bfloat16"):
        kvports.load("torch", dtype="float64", quant="int8")


def test_compare_reports_each_rows_cost_against_float32(capsys):
    port_or_skip("torch")
    argv = ["compare", "--quant", "int8", "--new-tokens", "4", "--repeats", "1", "--json"]
    code, out, _ = run_cli(capsys, *argv)
    result = json.loads(out)
    rows = {(row["framework"], row["mode"]): row for row in result["rows"]}
    for (framework, _), row in rows.items():
        if "int8" not in PRECISIONS[framework]:
            assert (row["available"], row["reason"]) == (False, "no int8")
            continue
        cost = row["vs_float32"]
        assert cost["max_abs_diff"] > 0 and set(cost) == {"max_abs_diff", "first_divergent_step", "reference_margin"}
    assert code == 0 and result["quant"] == "int8"
