"""GGUF files as weights and text: tiny random Llamas written by the gguf library as llama.cpp
writes them (q/k rows permuted, matrices quantized), read by every port and compared with
transformers' own GGUF loader. (Malformed files: tests/bad_input/test_gguf_files.py.)"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from kvports.formats.chat import gguf_chat_prompt
from kvports.formats.gguf import reader as gguf_reader
from kvports.formats.gguf.tokenizer import gguf_tokenizer
from kvports.formats.weights import GGUFWeights, open_weights
from kvports.shared.generation import GenerationConfig
from tests.helpers.agreement import assert_tokens_agree
from tests.helpers.commands import assert_one_error_line, run_cli
from tests.helpers.gguf_files import CHATML, GGUF_SIZE, gguf_tokens, hf_llama_tensors, write_gguf

QTYPES = ("F32", "F16", "Q8_0", "Q4_1")
NEW_TOKENS = 8
PROMPT = np.array([[5, 100, 37, 200, 9, 262]], dtype=np.int64)  # [1, 6]
GENERATE = ("generate", "--framework", "numpy", "--mode", "cached")
STRINGS = ["hello world", "<|im_start|>hi this world<|im_end|>", "héllo\n  wor ld!", "", "   "]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One tiny model per quantization type, each in its own folder (transformers loads by folder and name)."""
    out = {}
    for index, qtype in enumerate(QTYPES):
        folder = tmp_path_factory.mktemp(qtype)
        out[qtype] = write_gguf(folder / "tiny.gguf", qtype, tie=index % 2 == 0, seed=index)
    return out


class Reference:
    """transformers' GGUF loader's greedy tokens and step logits per (qtype, dtype), each computed once."""

    def __init__(self, files):
        self.files, self.runs = files, {}

    def __call__(self, qtype: str, dtype: str):
        if (qtype, dtype) not in self.runs:
            transformers = pytest.importorskip("transformers")
            pytest.importorskip("accelerate")
            import torch

            from tests.helpers.hf_reference import hf_generate

            path = self.files[qtype]
            # dequantize=True: weights unpacked at load (else transformers multiplies packed blocks in float32).
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path.parent,
                gguf_file=path.name,
                dtype=getattr(torch, dtype),
                quantization_config=transformers.GgufConfig(dequantize=True),
            ).eval()
            self.runs[(qtype, dtype)] = hf_generate(model, PROMPT, NEW_TOKENS)
        return self.runs[(qtype, dtype)]


@pytest.fixture(scope="module")
def reference(files):
    return Reference(files)


def port_tokens(port, path, dtype: str) -> np.ndarray:
    with GGUFWeights(path) as weights:
        config, tensors = weights.config, weights.read(dtype)
    model = port.load_model(config, tensors, dtype)
    tokens, _ = port.generate(model, PROMPT, GenerationConfig(NEW_TOKENS, 0.0, 0, 1.0, 0, ()), "cached")
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("qtype", QTYPES)
def test_tokens_equal_transformers_gguf_loader(port, files, reference, qtype, dtype):
    hf_tokens, hf_logits = reference(qtype, dtype)
    tokens = port_tokens(port, files[qtype], dtype)
    if dtype == "float64":
        np.testing.assert_array_equal(tokens, hf_tokens)
    else:
        assert_tokens_agree(hf_tokens, hf_logits, tokens, PROMPT.shape[1], f"{port.NAME} {qtype}")


def test_skipping_the_inverse_permutation_changes_the_tokens(files, reference, monkeypatch):
    from kvports.numpy_impl import port

    hf_tokens, _ = reference("F32", "float64")
    monkeypatch.setattr(gguf_reader, "unpermute", lambda weight, heads: weight)
    assert not np.array_equal(port_tokens(port, files["F32"], "float64"), hf_tokens)


def test_query_and_key_rows_come_back_in_transformers_order(tmp_path):
    hf = hf_llama_tensors(len(gguf_tokens()), tie=True)
    path = write_gguf(tmp_path / "f32.gguf", "F32", hf_tensors=hf)
    with GGUFWeights(path) as weights:
        qkv = weights.read()["blocks.1.qkv.weight"]
    a = "layers.1.self_attn."
    np.testing.assert_array_equal(
        qkv, np.concatenate([hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"]])
    )


def test_open_weights_reads_a_gguf_file_with_the_config_it_describes(files):
    with open_weights(files["Q4_1"]) as weights:
        config = weights.config
    assert (config.family, config.d_model, config.n_heads, config.kv_heads, config.n_layers) == (
        "llama",
        GGUF_SIZE["d_model"],
        GGUF_SIZE["n_heads"],
        GGUF_SIZE["n_kv_heads"],
        GGUF_SIZE["n_layers"],
    )
    assert (config.vocab_size, config.eos_token_ids, config.bos_token_id) == (len(gguf_tokens()), (2,), 1)


def test_tokenizer_equals_transformers_gguf_tokenizer(files):
    transformers = pytest.importorskip("transformers")
    path = files["F32"]
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = gguf_tokenizer(path)
    for text in STRINGS:
        ids = ours.encode(text).ids
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text


def test_chat_prompt_equals_transformers_chat_template(files):
    transformers = pytest.importorskip("transformers")
    path = files["F32"]
    messages = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "world"},
    ]
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert theirs.chat_template == CHATML
    expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert gguf_chat_prompt(path, messages) == expected


def test_chat_answer_is_decoded_text_in_json(capsys, files):
    code, out, err = run_cli(
        capsys, *GENERATE, "--weights", files["Q8_0"],
        "--chat", "hello", "--chat", "hi", "--chat", "world", "--new-tokens", 4, "--json",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out)
    text = gguf_tokenizer(files["Q8_0"]).decode(result["tokens"][0], skip_special_tokens=False)
    assert result["text"] == [text]
    assert text.startswith("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nhi<|im_end|>\n")


def test_chat_file_gives_the_same_prompt_as_chat_turns(capsys, files, tmp_path):
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps([{"role": "user", "content": "hello"}]))
    common = (
        *GENERATE,
        "--weights",
        files["F16"],
        "--new-tokens",
        2,
        "--json",
    )
    outputs = [run_cli(capsys, *common, *extra)[1] for extra in (("--chat", "hello"), ("--chat-file", chat))]
    assert json.loads(outputs[0])["tokens"] == json.loads(outputs[1])["tokens"]


def test_text_is_encoded_with_the_files_own_tokenizer(capsys, files):
    code, out, err = run_cli(
        capsys, *GENERATE, "--weights", files["F32"],
        "--text", "hello world", "--new-tokens", 2, "--json",
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["tokens"][0][:2] == gguf_tokenizer(files["F32"]).encode("hello world").ids


def test_unfetched_model_name_says_how_to_fetch_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KVPORTS_HOME", str(tmp_path))
    err = assert_one_error_line(*run_cli(capsys, *GENERATE, "--model", "smollm2"))
    assert "run kvports fetch smollm2" in err


# --- limits ------------------------------------------------------------------------------------


def test_dequantizing_past_the_byte_limit_is_refused(capsys, files, monkeypatch, tmp_path):
    path = shutil.copy(files["Q4_1"], tmp_path / "limit.gguf")
    monkeypatch.setenv("KVPORTS_MAX_BYTES", "400K")
    err = assert_one_error_line(*run_cli(capsys, "convert", "--from-gguf", path, "--out", tmp_path / "out.safetensors"))
    assert "dequantizing" in err and "above the limit" in err


def test_metadata_array_longer_than_its_bound_is_refused(files, monkeypatch):
    monkeypatch.setattr(gguf_reader, "MAX_ARRAY", 100)
    gguf_reader.cached_reader.cache_clear()  # a parse of this file made before the bound changed
    with pytest.raises(gguf_reader.UserError, match="metadata array of 271 items, above 100"):
        GGUFWeights(files["F16"])
    gguf_reader.cached_reader.cache_clear()


def test_every_metadata_field_reads_as_the_gguf_librarys_reader_reads_it(files):
    """The reader's own loop over string arrays (the tokenizer's) gives the library's values."""
    gguf = pytest.importorskip("gguf")
    path = files["F16"]
    ours, theirs = gguf_reader.bounded_reader(path, path.stat().st_size), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    strings = [key for key, field in theirs.fields.items() if field.types[-1] == gguf.GGUFValueType.STRING]
    assert "tokenizer.ggml.tokens" in strings and "tokenizer.ggml.merges" in strings
    for key, field in theirs.fields.items():
        assert ours.fields[key].types == field.types, key
        assert np.array_equal(np.asarray(ours.fields[key].contents()), np.asarray(field.contents())), key


# --- convert, and the flags' own refusals ---------------------------------------------------------


def test_convert_from_gguf_writes_the_dequantized_weights(capsys, files, tmp_path):
    from kvports.formats.weights import load_weights

    code, _, err = run_cli(capsys, "convert", "--from-gguf", files["Q4_1"], "--out", tmp_path / "q.safetensors")
    assert code == 0, err
    with GGUFWeights(files["Q4_1"]) as weights:
        expected = weights.read()
    config, tensors = load_weights(tmp_path / "q.safetensors")
    assert config.family == "llama"
    assert sorted(tensors) == sorted(expected)
    for name in expected:
        np.testing.assert_array_equal(tensors[name], expected[name], err_msg=name)


def test_convert_to_hf_from_gguf_writes_a_llama_directory_that_converts_back(capsys, files, tmp_path):
    from kvports.formats.weights import load_weights

    assert run_cli(capsys, "convert", "--to-hf", files["Q8_0"], "--out", tmp_path / "hf")[0] == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"
    assert run_cli(capsys, "convert", "--from-hf", tmp_path / "hf", "--out", tmp_path / "back.safetensors")[0] == 0
    with GGUFWeights(files["Q8_0"]) as weights:
        expected = weights.read()
    back = load_weights(tmp_path / "back.safetensors")[1]
    for name in expected:
        np.testing.assert_array_equal(back[name], expected[name], err_msg=name)


@pytest.mark.parametrize(
    "extra, words",
    [
        (("--chat", "hi", "--text", "hello"), "not two of them"),
        (("--chat", "hi", "--chat-file", "x.json"), "give --chat or --chat-file, not both"),
        (("--chat-file", "missing.json"), "does not exist"),
    ],
)
def test_chat_flags_refused_in_one_line(capsys, files, extra, words):
    argv = (*GENERATE, "--weights", files["F32"], *extra)
    assert words in assert_one_error_line(*run_cli(capsys, *argv))


def test_chat_file_that_is_not_a_message_list_is_refused(capsys, files, tmp_path):
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps([{"role": "user", "text": "hi"}]))
    argv = (*GENERATE, "--weights", files["F32"], "--chat-file", chat)
    assert "message 0 is" in assert_one_error_line(*run_cli(capsys, *argv))


def test_chat_without_a_gguf_file_says_what_it_needs(capsys):
    err = assert_one_error_line(*run_cli(capsys, *GENERATE, "--chat", "hi"))
    assert "--tokenizer DIR" in err and "GGUF file" in err
