"""The torch port's linear(): on the CPU, bfloat16 weights go to oneDNN reordered once, float32
weights to MKL in the layout the loader chose by shared.shapes.stored_transposed ([in, out] for a
matrix with at least as many outputs as inputs, [out, in] rows for a down projection). The route
must not change what is computed."""

from __future__ import annotations

import dataclasses

import pytest

from kvports.shared.config import ModelConfig
from tests.helpers.agreement import assert_logits_close, assert_tokens_agree
from tests.helpers.models import random_prompts, random_weights
from tests.helpers.ports import port_or_skip

torch = pytest.importorskip("torch")
onednn = pytest.importorskip("kvports.torch_impl.fast.onednn")

needs_onednn = pytest.mark.skipif(not onednn.ONEDNN, reason="this torch build has no oneDNN linear")
# oneDNN's packed bfloat16 linear needs AVX-512 or AVX-NE-CONVERT (tests/test_cpu_routes.py holds the plain route)
needs_packed = pytest.mark.skipif(not onednn.packed_bfloat16(), reason="this CPU runs no packed bfloat16 linear")

# Matrices large enough (the FFN's 256 x 1024 = 2**18 elements, the 1100 x 256 head) for oneDNN stored [out, in].
STREAMED_CONFIG = ModelConfig(vocab_size=1100, d_model=256, n_heads=4, n_layers=1, max_seq_len=64)


@needs_packed
def test_linear_takes_onednn_only_for_bfloat16_without_autograd(monkeypatch):
    calls = []
    onednn_linear = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(onednn, "_onednn_linear", lambda *args: calls.append(args[0].dtype) or onednn_linear(*args))
    weight = torch.ones(1024, 256)
    with torch.inference_mode():
        onednn.linear(torch.ones(1, 256, dtype=torch.bfloat16), weight.bfloat16())
        onednn.linear(torch.ones(1, 256), weight)  # float32: MKL through F.linear
        onednn.linear(torch.ones(1, 256, dtype=torch.float64), weight.double())  # float64: F.linear
    onednn.linear(torch.ones(1, 256, dtype=torch.bfloat16), weight.bfloat16())  # autograd on: F.linear
    assert calls == [torch.bfloat16]


@needs_packed
@pytest.mark.parametrize("rows", [1, 7])
def test_bfloat16_linear_through_a_packed_weight_equals_f_linear(rows):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=generator).bfloat16()
    bias, x = torch.randn(96, generator=generator).bfloat16(), torch.randn(2, rows, 64, generator=generator).bfloat16()
    with torch.inference_mode():
        routed = onednn.linear(x, weight, bias)  # [2, rows, 96]
    expected = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(routed.float(), expected, rtol=2e-2, atol=2e-2)


@needs_packed
def test_bfloat16_packed_weight_follows_an_in_place_change():
    weight, x = torch.ones(96, 64, dtype=torch.bfloat16), torch.ones(1, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        before = onednn.linear(x, weight)  # packs the weight
    weight.mul_(2)
    with torch.inference_mode():
        after = onednn.linear(x, weight)  # [1, 96]
    torch.testing.assert_close(after.float(), 2 * before.float())


@pytest.mark.parametrize("name, transposed", [("blocks.0.qkv.weight", True), ("blocks.0.ffn.2.weight", False)])
def test_float32_weights_load_in_the_shared_layout_with_the_same_values(name, transposed):
    """qkv (768 x 256) is laid out [in, out]; the down projection (256 x 1024) keeps its [out, in] rows."""
    torch_port = port_or_skip("torch")
    tensors = random_weights(STREAMED_CONFIG)
    model = torch_port.load_model(STREAMED_CONFIG, tensors)
    weight = model.get_parameter(name)  # [out, in]
    assert (weight.t().is_contiguous(), weight.is_contiguous()) == (transposed, not transposed)
    torch.testing.assert_close(weight.detach(), torch.from_numpy(tensors[name]), rtol=0, atol=0)


def test_a_tied_head_takes_the_same_route_over_the_embeddings_own_weight():
    """Loading makes the tied head a Linear of its own over the embedding's weight (the same tensor,
    not a copy), so it streams as every other matrix; the lookup reads that tensor too."""
    torch_port = port_or_skip("torch")
    config = dataclasses.replace(STREAMED_CONFIG, tie_embeddings=True)
    tensors = {name: array for name, array in random_weights(STREAMED_CONFIG).items() if name != "head.weight"}
    model = torch_port.load_model(config, tensors)
    assert type(model.head) is onednn.Linear and model.head.weight is model.emb.weight
    assert not model.config.tie_embeddings and model.emb.weight.t().is_contiguous()
    torch.testing.assert_close(model.emb.weight.detach(), torch.from_numpy(tensors["emb.weight"]), rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["naive", "cached"])
def test_torch_on_streamed_weights_matches_numpy(mode):
    """A model whose weights the loader laid out for MKL gives NumPy's tokens and logits."""
    torch_port, numpy_port = port_or_skip("torch"), port_or_skip("numpy")
    tensors = random_weights(STREAMED_CONFIG)
    prompts = random_prompts(STREAMED_CONFIG.vocab_size, 2, 5)
    tokens, logits = torch_port.generate(torch_port.load_model(STREAMED_CONFIG, tensors), prompts, 12, mode, True)
    ref_tokens, ref_logits = numpy_port.generate(
        numpy_port.load_model(STREAMED_CONFIG, tensors), prompts, 12, mode, True
    )
    agreement = assert_tokens_agree(ref_tokens, ref_logits, tokens, 5, f"torch {mode}")
    assert_logits_close(ref_logits, logits, 1e-4, agreement, f"torch {mode}")


@needs_onednn
@pytest.mark.slow
def test_linear_over_a_large_weight_compiles_with_torch_compile():
    """Inductor cannot lower the unfrozen oneDNN op: under torch.compile linear() is F.linear."""
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(1024, 256, generator=generator), torch.randn(1, 1, 256, generator=generator)
    compiled = torch.compile(onednn.linear)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x, weight), torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)
