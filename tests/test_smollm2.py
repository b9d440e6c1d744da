"""The real SmolLM2-135M-Instruct (a Q4_1 GGUF file, `make model` fetches it): every port's
greedy chat answer equals transformers' on the same file, and it names Paris."""

from __future__ import annotations

import contextlib
import functools
import json

import numpy as np
import pytest

from kvports.formats.chat import chat_ids
from kvports.formats.gguf.tokenizer import gguf_tokenizer
from kvports.formats.weights import GGUFWeights
from kvports.hub import model_path
from kvports.shared.errors import UserError
from kvports.shared.generation import GenerationConfig
from tests.helpers.agreement import assert_tokens_agree, assert_within_format_distance
from tests.helpers.commands import run_cli

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
NEW_TOKENS = 12
EOS = 2  # <|im_end|>, the file's eos
STRINGS = ["What is the capital of France?", "  Two  spaces,\ttabs\nand lines.", "naïve café 東京 🙂", "1234567 x=3.14"]


@pytest.fixture(scope="module")
def path():
    try:
        return model_path("smollm2")
    except UserError:
        pytest.skip("SmolLM2 is not fetched: run make model")


@pytest.fixture(scope="module")
def weights(path):
    with GGUFWeights(path) as file:
        return file.config, file.read("float32")


@pytest.fixture(scope="module")
def prompt(path):
    return np.array([chat_ids(path, QUESTION, gguf_tokenizer(path))], dtype=np.int64)  # [1, P]


@pytest.fixture(scope="module")
def parsed_once():
    """A context for transformers' loads of the file: gguf-py's reader made once per file and its
    tensor-name map once per (architecture, layers), each a pure function of its arguments. transformers
    parsed the file's 100,000 strings on each load (its config, its tensors, its tokenizer) and built
    the map again for every tensor: seconds each. What it reads and computes is unchanged."""
    gguf = pytest.importorskip("gguf")
    readers: dict = {}
    name_maps = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = library_reader(path, *args, **kwargs)
        return readers[key]

    library_reader = gguf.GGUFReader

    @contextlib.contextmanager
    def context():
        # Only around transformers' calls: kvports' own reader subclasses the library's class.
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(gguf, "GGUFReader", reader)
            patch.setattr(gguf, "get_tensor_name_map", name_maps)
            yield

    return context


@pytest.fixture(scope="module")
def transformers_answer(path, prompt, parsed_once):
    """transformers' greedy answer on the same file, stopping at <|im_end|> as ours does: its tokens
    [1, P + n] and step logits [1, n, V]."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import torch

    from kvports.baselines.hf_transformers import load_gguf

    with parsed_once():
        model = load_gguf(path)
    with torch.no_grad():
        out = model.generate(
            torch.from_numpy(prompt),
            attention_mask=torch.ones_like(torch.from_numpy(prompt)),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=EOS,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences.numpy(), torch.stack(out.logits, dim=1).to(torch.float64).numpy()


def test_tokenizer_equals_transformers_on_the_real_file(path, parsed_once):
    transformers = pytest.importorskip("transformers")
    with parsed_once():
        theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = gguf_tokenizer(path)
    for text in STRINGS:
        assert ours.encode(text).ids == theirs(text)["input_ids"], text
    prompt = theirs.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert chat_ids(path, QUESTION, ours) == theirs(prompt, add_special_tokens=False)["input_ids"]


def test_chat_answer_equals_transformers_and_names_paris(port, path, weights, prompt, transformers_answer):
    config, tensors = weights
    hf_tokens, hf_logits = transformers_answer
    model = port.load_model(config, tensors, "float32")
    tokens, _ = port.generate(model, prompt, GenerationConfig(NEW_TOKENS, 0.0, 0, 1.0, 0, (EOS,)), "cached")
    tokens = tokens[:, : hf_tokens.shape[1]]  # PAD after our stop, where transformers' output ends
    assert_tokens_agree(hf_tokens, hf_logits, tokens, prompt.shape[1], port.NAME)
    answer = [int(t) for t in tokens[0, prompt.shape[1] :] if t != EOS]
    assert "Paris" in gguf_tokenizer(path).decode(answer)


def test_chat_command_answers_in_text(capsys, path):
    code, out, err = run_cli(
        capsys, "generate", "--framework", "numpy", "--mode", "cached", "--weights", path,
        "--chat", QUESTION[0]["content"], "--new-tokens", NEW_TOKENS, "--json",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out)
    assert result["finish_reason"] == ["stop"] and result["text"][0].endswith(
        "The capital of France is Paris.<|im_end|>"
    )


# Accepted means it runs on the real model too (tests/test_accepted.py on a tiny file): every torch format
# through the load cache, and those whose quantizers or packed layouts read the tensors on the first load
# (which builds the cache) and with the cache off as well; under KVPORTS_CPU=avx2 too. JAX's formats run
# there on the tiny file: compiling the 30-layer model once per format would take minutes here.
TORCH_FORMATS = [
    ("float32", "none"), ("float64", "none"), ("bfloat16", "none"), ("float32", "int8"),
    ("float32", "q4"), ("bfloat16", "int8"), ("bfloat16", "q4"),
]  # fmt: skip
EVERY_PATH = {("float32", "int8"), ("bfloat16", "q4")}


@pytest.fixture(scope="module")
def fresh_home(tmp_path_factory):
    """An empty $KVPORTS_HOME (the load cache), for this module's loads of the file."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVPORTS_HOME", str(tmp_path_factory.mktemp("home")))
        yield patch


def test_every_torch_format_answers_on_the_first_the_mapped_and_the_uncached_load(path, prompt, fresh_home):
    kvports = pytest.importorskip("kvports")
    pytest.importorskip("torch")
    question = prompt[0].tolist()

    def answer(dtype: str, quant: str, route: str = "native") -> tuple[np.ndarray, np.ndarray]:
        fresh_home.setenv("KVPORTS_CPU", route)
        model = kvports.load("torch", path, dtype, quant=quant)
        result = model.generate(question, new_tokens=6, stop_ids=[], return_logits=True)
        return np.array(result.tokens), result.logits

    first = answer("float32", "int8")  # builds the load cache
    tokens32, logits32 = answer("float32", "none")
    runs = {("first load", "float32", "int8"): first}
    for dtype, quant in TORCH_FORMATS:
        runs["mapped", dtype, quant] = answer(dtype, quant)
        if dtype == "bfloat16":
            runs["mapped, KVPORTS_CPU=avx2", dtype, quant] = answer(dtype, quant, "avx2")
    fresh_home.setenv("KVPORTS_LOAD_CACHE", "0")
    for dtype, quant in sorted(EVERY_PATH):
        runs["cache off", dtype, quant] = answer(dtype, quant)
    for (label, dtype, quant), (tokens, logits) in runs.items():
        assert_within_format_distance(tokens32, logits32, tokens, logits, len(question), dtype, quant, label)
