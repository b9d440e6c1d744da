"""GGUF files of each family, made the way users get them: a tiny random transformers model
converted by llama.cpp's own convert_hf_to_gguf.py (tests/helpers/llama_cpp_converter.py), so
llama.cpp's tensor names, row orders and metadata keys are its converter's, not kvports' reading of
them. Each file gives transformers' greedy tokens in every port, naive and cached, at float32 and float64, and
llama.cpp's own (F32) where llama-cpp-python is installed (the peers extra), near-ties reported."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")  # the converter imports it for every family
import torch

from kvports.agreement import comparable_steps, compare_tokens, logit_difference
from kvports.formats.gguf.writer import write_gguf
from kvports.formats.weights import load_weights
from tests.helpers.hf_reference import FAMILY_CASES, Case, hf_generate, save_hf
from tests.helpers.llama_cpp_converter import convert, converter_root, write_tokenizer
from tests.helpers.models import random_prompts

# Six conversions in one process importing torch and transformers (the first run also fetches the
# converter, about a minute).
pytestmark = pytest.mark.slow
NEW_TOKENS = 8
# One model a family, as llama.cpp runs it: Llama 3 (its rope_freqs.weight), Qwen2, Qwen3, Gemma 3
# (every sixth layer global), Phi-3 (fused qkv and gate/up).
GGUF_CASES = {
    "llama": "llama3-gqa-tied",
    "qwen2": "qwen2-gqa-tied",
    "qwen3": "qwen3-gqa-untied",
    "gemma3": "gemma3-six-layers",
    "phi3": "phi3-window-gqa",
}
PHI3_NO_WINDOW = Case("phi3", (("num_key_value_heads", 2),), seed=14, prompt=(1, 6))
LOGITS_ATOL = 1e-4  # float32 through two frameworks' kernels
# llama.cpp's GELU reads a table of float16 values (ggml-cpu/vec.h, GGML_GELU_FP16): Gemma 3's logits come
# 1.6e-3 off ours; the other families', 1e-5.
LLAMA_CPP_ATOL = 5e-3


@pytest.fixture(scope="session")
def converter():
    try:
        return converter_root()
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        pytest.skip(f"llama.cpp's converter could not be fetched from llama-cpp-python's sdist on PyPI ({exc})")


@pytest.fixture(scope="module")
def converted(converter, tmp_path_factory) -> dict[str, tuple]:
    """Case name -> its transformers model, its file as llama.cpp's converter writes it (config, tensors, path)
    and its prompts: GGUF_CASES' and PHI3_NO_WINDOW's, every file converted by one process."""
    cases = {name: FAMILY_CASES[name] for name in GGUF_CASES.values()} | {"phi3-no-window": PHI3_NO_WINDOW}
    models, jobs = {}, []
    for name, case in cases.items():
        models[name] = case.build(torch.float32)
        directory = save_hf(models[name], tmp_path_factory.mktemp(name))
        write_tokenizer(directory, models[name].config.vocab_size, models[name].config.model_type)
        jobs.append((directory, directory.parent / f"{name}.gguf"))
    convert(converter, jobs)
    made = {}
    for (name, case), (_, path) in zip(cases.items(), jobs, strict=True):
        config, tensors = load_weights(path)
        prompts = random_prompts(config.vocab_size, *case.prompt, seed=case.prompt[1])
        made[name] = (models[name], config, tensors, prompts, path)
    return made


@pytest.fixture(scope="module")
def families(converted):
    """arch -> (the file's config and tensors, prompts, transformers' tokens and step logits by dtype, the file)."""
    made = {}
    for arch, name in GGUF_CASES.items():
        model, config, tensors, prompts, path = converted[name]
        float32 = hf_generate(model, prompts, NEW_TOKENS)
        # The file's F32 weights, computed in float64 by transformers as by the ports.
        made[arch] = (
            config,
            tensors,
            prompts,
            {"float32": float32, "float64": hf_generate(model.double(), prompts, NEW_TOKENS)},
            path,
        )
    return made


def test_each_architecture_reads_as_its_family(families):
    found = {arch: families[arch][0].family for arch in GGUF_CASES}
    assert found == {"llama": "llama3", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3", "phi3": "mistral"}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("mode", ["naive", "cached"])
@pytest.mark.parametrize("arch", GGUF_CASES)
def test_a_converted_file_gives_transformers_greedy_tokens(port, families, arch, mode, dtype):
    config, tensors, prompts, hf_runs, _ = families[arch]
    hf_tokens, hf_logits = hf_runs[dtype]
    tokens, logits = port.generate(
        port.load_model(config, tensors, dtype), prompts, NEW_TOKENS, mode, return_logits=True
    )
    np.testing.assert_array_equal(tokens, hf_tokens)
    np.testing.assert_allclose(logits, hf_logits, rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("arch", GGUF_CASES)
def test_a_family_file_written_back_reads_as_the_same_model(families, arch, tmp_path):
    """kvports' GGUF writer (the bench's llama.cpp rows) keeps the architecture, its tensor names and
    row orders: the file it writes reads back as the config and tensors it was given."""
    config, tensors, *_, source = families[arch]
    back_config, back = load_weights(write_gguf(tmp_path / "back.gguf", config, tensors, source))
    assert back_config == config and back.keys() == tensors.keys()
    for name, array in tensors.items():
        np.testing.assert_array_equal(back[name], array, err_msg=name)


@pytest.fixture(scope="module")
def phi3_no_window(converted):
    """A Phi-3 with no sliding window: its converter writes phi3.attention.sliding_window = 0."""
    model, config, tensors, prompts, path = converted["phi3-no-window"]
    return config, tensors, prompts, hf_generate(model, prompts, NEW_TOKENS)[0], path


def test_a_window_of_0_reads_as_none_and_gives_transformers_greedy_tokens(port, phi3_no_window):
    config, tensors, prompts, hf_tokens, _ = phi3_no_window
    assert config.sliding_window is None
    tokens, _ = port.generate(port.load_model(config, tensors, "float32"), prompts, NEW_TOKENS, "cached")
    np.testing.assert_array_equal(tokens, hf_tokens)


@pytest.fixture(scope="module")
def llama_cpp_runs(families, phi3_no_window):
    """arch -> the file's config, tensors and prompts, and llama.cpp's greedy tokens [B, P + N] and step logits
    [B, N, V] on it (F32 weights, F32 attention), a row at a time (its row decodes one sequence)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install 'kvports[peers]')")
    from kvports.baselines import llama_cpp

    files = {arch: (config, tensors, prompts, path) for arch, (config, tensors, prompts, *_, path) in families.items()}
    # llama.cpp turns Phi-3's sliding window off (src/models/phi3.cpp: "Phi SWA is currently disabled"), so
    # its Phi-3 file here has none; the windowed one is held to transformers above.
    config, tensors, prompts, _, path = phi3_no_window
    files["phi3"] = (config, tensors, prompts, path)
    made = {}
    for arch, (config, tensors, prompts, path) in files.items():
        model = llama_cpp.load_model(config, tensors, source=path, threads=1, f32_attention=True)
        rows = [llama_cpp.generate(model, prompt[None], NEW_TOKENS, return_logits=True) for prompt in prompts]
        tokens = np.concatenate([t for t, _ in rows])  # [B, P + N]
        made[arch] = (config, tensors, prompts, tokens, np.concatenate([logits for _, logits in rows]))
    return made


@pytest.mark.parametrize("arch", GGUF_CASES)
def test_a_converted_file_gives_llama_cpps_f32_tokens_but_at_near_ties(port, llama_cpp_runs, arch):
    """llama.cpp reads the file by its own conventions (Gemma 3's global layers and attention scale
    included, which the file does not record): every port's float32 tokens are its tokens, unless the
    first step they part at is a near-tie of llama.cpp's logits; the logits are close where both ran
    the same history."""
    config, tensors, prompts, reference_tokens, reference_logits = llama_cpp_runs[arch]
    tokens, logits = port.generate(port.load_model(config, tensors, "float32"), prompts, NEW_TOKENS, "cached", True)
    agreement = compare_tokens(reference_tokens, tokens, prompts.shape[1], reference_logits)
    assert agreement.explained, agreement.describe()
    compared = comparable_steps(reference_tokens, tokens, prompts.shape[1])
    difference = logit_difference(reference_logits, logits, compared, teacher_forced=False)
    assert difference is not None and difference.max_abs_diff < LLAMA_CPP_ATOL, difference
