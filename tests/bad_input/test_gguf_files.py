"""GGUF files kvports refuses: truncated, a tensor's offset past the end, tensors overlapping,
misaligned or followed by stray bytes (llama.cpp's layout), a quantization type unknown or not
read, another architecture, a tokenizer of another size, RoPE scaling, a llama key kvports does not
model, a layer count past the tensors present, metadata nested or counted without bound, a
big-endian file. One `error:` line, exit 2, the same in every port; nothing written from such a file."""

from __future__ import annotations

import struct

import pytest

from tests.helpers.commands import assert_one_error_line, refusals_in_every_framework, run_cli
from tests.helpers.gguf_files import edit_gguf_tensor, gguf_tensor_offset, gguf_tokens, raw_gguf, write_gguf


def truncated(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


def lying_offset(path):
    edit_gguf_tensor(path, "blk.0.ffn_down.weight", 5, 10**12)


def unknown_type(path):
    edit_gguf_tensor(path, "blk.0.ffn_down.weight", 4, 99)


def overlapping(path):
    edit_gguf_tensor(path, "blk.0.ffn_up.weight", 5, gguf_tensor_offset(path, "blk.0.ffn_gate.weight"))


def misaligned(path):
    edit_gguf_tensor(path, "blk.0.ffn_up.weight", 5, gguf_tensor_offset(path, "blk.0.ffn_up.weight") + 4)


def stray_bytes(path):
    with open(path, "ab") as handle:
        handle.write(bytes(64))


BAD = {
    "truncated": (truncated, {}, "is truncated or lies"),
    "lying tensor offset": (lying_offset, {}, "runs past its end"),
    "unknown quant type": (unknown_type, {}, "unknown quantization type 99"),
    "unsupported quant type": (None, {"qtype": "Q5_0"}, "has type Q5_0; kvports reads"),
    "not llama": (None, {"arch": "gpt2"}, "general.architecture='gpt2'"),
    "tokenizer size": (None, {"metadata": {"llama.vocab_size": len(gguf_tokens()) + 1}}, "differs from the vocabulary"),
    "rope scaling": (None, {"metadata": {"llama.rope.scaling.type": "yarn"}}, "plain RoPE only"),
    "unknown llama key": (None, {"metadata": {"llama.expert_count": 8}}, "llama.expert_count=8"),
    "overlapping tensors": (overlapping, {}, "tensor 'blk.0.ffn_up.weight' is at data offset"),
    "misaligned tensor": (misaligned, {}, "running sum of the 32-byte aligned sizes"),
    "bytes after the tensors": (stray_bytes, {}, "has a data section of"),
    "block_count past the tensors": (None, {"metadata": {"llama.block_count": 10**9}}, "tensors of 2 layers"),
    "big-endian": (None, {"big_endian": True}, "is big-endian"),
}


@pytest.mark.parametrize("case", BAD)
def test_malformed_file_is_one_error_line_in_every_port(capsys, tmp_path, case):
    edit, options, words = BAD[case]
    path = write_gguf(tmp_path / "bad.gguf", **{"qtype": "Q8_0", **options})
    if edit is not None:
        edit(path)
    assert words in refusals_in_every_framework(capsys, "--weights", path, "--new-tokens", 2)


ARRAY, UINT8 = 9, 0
RAW = {
    # 3,000 arrays each holding the next: 36 KB
    "metadata nested 3000 deep": (struct.pack("<IQ", ARRAY, 1) * 2999 + struct.pack("<IQ", UINT8, 0), "nests"),
    # 3.9 million bytes in one array: the library alone took a minute and a gigabyte
    "one array of 3.9 million items": (struct.pack("<IQ", UINT8, 3_900_000) + bytes(3_900_000), "3900000 items"),
}


@pytest.mark.parametrize("case", RAW)
def test_unbounded_metadata_is_one_error_line_in_every_port(capsys, tmp_path, case):
    value, words = RAW[case]
    path = raw_gguf(tmp_path / "bad.gguf", "general.bad", ARRAY, value)
    assert words in refusals_in_every_framework(capsys, "--weights", path, "--new-tokens", 2)


@pytest.mark.parametrize("case", ["overlapping tensors", "misaligned tensor"])
def test_convert_writes_nothing_from_a_file_that_fails_the_layout(capsys, tmp_path, case):
    path = write_gguf(tmp_path / "bad.gguf", "Q8_0")
    BAD[case][0](path)
    out = tmp_path / "out.safetensors"
    err = assert_one_error_line(*run_cli(capsys, "convert", "--from-gguf", path, "--out", out))
    assert "llama.cpp's rule" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_a_vocabulary_token_that_is_not_utf8_is_one_error_line_even_for_token_ids(capsys, tmp_path):
    path = write_gguf(tmp_path / "bad.gguf", "Q8_0")
    data = path.read_bytes()
    token = "\u0120world".encode()  # the merged token "Ġworld", in the vocabulary alone
    assert data.count(token) == 1
    path.write_bytes(data.replace(token, b"\xff" + token[1:]))
    argv = ("--framework", "numpy", "--mode", "cached", "--weights", path, "--prompt", "1,5,9", "--new-tokens", 2)
    err = assert_one_error_line(*run_cli(capsys, "generate", *argv))
    assert "tokenizer.ggml.tokens" in err and "not UTF-8" in err
