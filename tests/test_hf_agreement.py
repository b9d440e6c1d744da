"""Every port, naive and cached, against transformers' own models and `generate`.

Each model is built with transformers' classes (GPT2LMHeadModel, LlamaForCausalLM,
MistralForCausalLM, and the families built on Llama: Llama 3's scaled RoPE, Qwen2, Qwen3,
Gemma 3, Phi-3), saved with `save_pretrained`, converted from disk by
`kvports convert --from-hf`, and run by the port; transformers' greedy generate (with
its own KV cache) is the reference.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("transformers")
import torch

from kvports.cli import main
from kvports.formats.weights import load_weights
from kvports.shared.generation import pad_prompts
from tests.helpers.hf_reference import CASES, FAMILY_CASES, hf_generate, save_hf
from tests.helpers.models import random_prompts

ALL_CASES = {**CASES, **FAMILY_CASES}
# What runs in the fast suite: the two families with the most switches, at float64; every other
# case and dtype is slow (a JAX compile per case and mode).
FAST = {("qwen3-gqa-untied", "float64"), ("gemma3-window-gqa-tied", "float64")}
CASE_DTYPES = [
    pytest.param(case, dtype, marks=() if (case, dtype) in FAST else pytest.mark.slow)
    for case in ALL_CASES
    for dtype in ("float32", "float64")
]

NEW_TOKENS = 10
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}
# transformers' Llama and Mistral compute RMSNorm and the RoPE tables in float32 even in
# a float64 model, so float64 logits agree to ~5e-6, not to float64 precision.
LOGITS_ATOL = 1e-4


class Runs:
    """transformers' results per (case, dtype) and ours per (port, case, dtype, mode), each
    computed once: several tests read the same runs."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory
        self.hf, self.ours = {}, {}

    def reference(self, case_name: str, dtype: str):
        """(config, tensors converted from disk, (prompts, transformers' tokens, its step logits))."""
        if (case_name, dtype) not in self.hf:
            model = ALL_CASES[case_name].build(TORCH_DTYPES[dtype])
            directory = save_hf(model, self.tmp_path_factory.mktemp(case_name))
            out = directory.parent / f"{case_name}-{dtype}.safetensors"
            assert main(["convert", "--from-hf", str(directory), "--out", str(out)]) == 0
            config, tensors = load_weights(out)
            batch, length = ALL_CASES[case_name].prompt
            prompts = random_prompts(config.vocab_size, batch, length, seed=length)
            self.hf[(case_name, dtype)] = (config, tensors, (prompts, *hf_generate(model, prompts, NEW_TOKENS)))
        return self.hf[(case_name, dtype)]

    def port_run(self, port, case_name: str, dtype: str, mode: str):
        key = (port.NAME, case_name, dtype, mode)
        if key not in self.ours:
            config, tensors, (prompts, hf_tokens, hf_logits) = self.reference(case_name, dtype)
            model = port.load_model(config, tensors, dtype)
            tokens, logits = port.generate(model, prompts, NEW_TOKENS, mode, return_logits=True)
            self.ours[key] = (tokens, logits, hf_tokens, hf_logits)
        return self.ours[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory)


@pytest.mark.parametrize("mode", ["naive", "cached"])
@pytest.mark.parametrize("case, dtype", CASE_DTYPES)
def test_greedy_tokens_equal_transformers_generate(port, runs, case, dtype, mode):
    tokens, _, hf_tokens, _ = runs.port_run(port, case, dtype, mode)
    np.testing.assert_array_equal(tokens, hf_tokens)


@pytest.mark.parametrize("mode", ["naive", "cached"])
@pytest.mark.parametrize("case, dtype", CASE_DTYPES)
def test_step_logits_allclose_to_transformers(port, runs, case, dtype, mode):
    _, logits, _, hf_logits = runs.port_run(port, case, dtype, mode)
    np.testing.assert_allclose(logits, hf_logits, rtol=0, atol=LOGITS_ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("window", [3, 5, None])
def test_mistral_window_off_by_one_disagrees_with_transformers(port, runs, window):
    """transformers' window W shows a query W keys, itself included (key > query - W), as
    ours does. The agreement above is no accident of a window that never bites: one key
    fewer or more (or no window) and the 6-token prompt's logits part from transformers'."""
    config, tensors, (prompts, _, hf_logits) = runs.reference("mistral-window", "float64")
    assert config.sliding_window == 4 and prompts.shape[1] == 6
    model = port.load_model(dataclasses.replace(config, sliding_window=window), tensors, "float64")
    _, logits = port.generate(model, prompts, 1, "naive", return_logits=True)
    assert np.abs(logits[:, 0] - hf_logits[:, 0]).max() > 100 * LOGITS_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["naive", "cached"])
@pytest.mark.parametrize("case", ["gpt2-tied", "llama-gqa-untied", "mistral-window", "gemma3-window-gqa-tied"])
def test_a_ragged_batch_equals_transformers_with_left_padding(port, runs, case, mode):
    config, tensors, _ = runs.reference(case, "float64")
    prompts, _ = pad_prompts([[5, 9, 2, 40, 7, 1], [11, 3], [60, 1, 33]])  # [3, 6], PAD on the left
    hf_tokens, _ = hf_generate(ALL_CASES[case].build(torch.float64), prompts, NEW_TOKENS)
    tokens, _ = port.generate(port.load_model(config, tensors, "float64"), prompts, NEW_TOKENS, mode)
    assert tokens[:, 6:].tolist() == hf_tokens[:, 6:].tolist()


@pytest.mark.parametrize("switch", ["global_layers", "rope_local_theta", "attn_scale", "embed_scale"])
def test_each_gemma3_switch_changes_the_logits(port, runs, switch):
    """The Gemma 3 case agrees with transformers only with every switch where it acts: drop one
    (every layer windowed, one RoPE base, the default scale, no embedding scale) and the logits part."""
    config, tensors, (prompts, _, hf_logits) = runs.reference("gemma3-window-gqa-tied", "float64")
    assert config.global_layers == (1,) and config.sliding_window == 3 < prompts.shape[1]
    off = {"global_layers": (), "rope_local_theta": None, "attn_scale": None, "embed_scale": 1.0}
    model = port.load_model(dataclasses.replace(config, **{switch: off[switch]}), tensors, "float64")
    _, logits = port.generate(model, prompts, 1, "naive", return_logits=True)
    assert np.abs(logits[:, 0] - hf_logits[:, 0]).max() > 100 * LOGITS_ATOL
