"""GGUF files of each family, made the way users get them: a tiny random transformers model
converted by llama.cpp's own convert_hf_to_gguf.py (tests/helpers/llama_cpp_converter.py), so
llama.cpp's tensor names, row orders and metadata keys are its converter's, not kvports' reading of
them. Each file gives transformers' greedy tokens in every port, naive and cached, at float32."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")  # the converter imports it for every family
import torch

from kvports.formats.gguf.writer import write_gguf
from kvports.formats.weights import load_weights
from tests.helpers.hf_reference import FAMILY_CASES, hf_generate, save_hf
from tests.helpers.llama_cpp_converter import convert, converter_root, write_tokenizer
from tests.helpers.models import random_prompts

# Five conversions, each a process importing torch and transformers (about a minute; the first run
# also fetches the converter, about another).
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
LOGITS_ATOL = 1e-4  # float32 through two frameworks' kernels


@pytest.fixture(scope="session")
def converter():
    try:
        return converter_root()
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        pytest.skip(f"llama.cpp's converter could not be fetched from llama-cpp-python's sdist on PyPI ({exc})")


@pytest.fixture(scope="module")
def families(converter, tmp_path_factory):
    """arch -> (the GGUF file's config and tensors, prompts, transformers' tokens and step logits)."""
    made = {}
    for arch, name in GGUF_CASES.items():
        case = FAMILY_CASES[name]
        model = case.build(torch.float32)
        directory = save_hf(model, tmp_path_factory.mktemp(name))
        write_tokenizer(directory, model.config.vocab_size, model.config.model_type)
        config, tensors = load_weights(convert(converter, directory, directory.parent / f"{name}.gguf"))
        prompts = random_prompts(config.vocab_size, *case.prompt, seed=case.prompt[1])
        made[arch] = (
            config,
            tensors,
            prompts,
            *hf_generate(model, prompts, NEW_TOKENS),
            directory.parent / f"{name}.gguf",
        )
    return made


def test_each_architecture_reads_as_its_family(families):
    found = {arch: families[arch][0].family for arch in GGUF_CASES}
    assert found == {"llama": "llama3", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3", "phi3": "mistral"}


@pytest.mark.parametrize("mode", ["naive", "cached"])
@pytest.mark.parametrize("arch", GGUF_CASES)
def test_a_converted_file_gives_transformers_greedy_tokens(port, families, arch, mode):
    config, tensors, prompts, hf_tokens, hf_logits, _ = families[arch]
    tokens, logits = port.generate(
        port.load_model(config, tensors, "float32"), prompts, NEW_TOKENS, mode, return_logits=True
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
