"""GGUF files kvports refuses: truncated, a tensor's offset past the end, a quantization type
unknown or not read, another architecture, a tokenizer of another size, RoPE scaling, a llama key
kvports does not model. One `error:` line, exit 2, the same in every port."""

from __future__ import annotations

import pytest

from kvports.registry import PORTS
from tests.helpers.commands import assert_one_error_line, run_cli
from tests.helpers.gguf_files import edit_gguf_tensor, gguf_tokens, write_gguf


def truncated(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


def lying_offset(path):
    edit_gguf_tensor(path, "blk.0.ffn_down.weight", 5, 10**12)


def unknown_type(path):
    edit_gguf_tensor(path, "blk.0.ffn_down.weight", 4, 99)


def unsupported_type(path):
    edit_gguf_tensor(path, "blk.0.ffn_down.weight", 4, 6)  # Q5_0, fewer bytes than the Q8_0 it replaces


BAD = {
    "truncated": (truncated, {}, "is truncated or lies"),
    "lying tensor offset": (lying_offset, {}, "runs past its end"),
    "unknown quant type": (unknown_type, {}, "unknown quantization type 99"),
    "unsupported quant type": (unsupported_type, {}, "has type Q5_0; kvports reads"),
    "not llama": (None, {"arch": "gpt2"}, "general.architecture='gpt2'"),
    "tokenizer size": (None, {"metadata": {"llama.vocab_size": len(gguf_tokens()) + 1}}, "differs from the vocabulary"),
    "rope scaling": (None, {"metadata": {"llama.rope.scaling.type": "yarn"}}, "plain RoPE only"),
    "unknown llama key": (None, {"metadata": {"llama.expert_count": 8}}, "llama.expert_count=8"),
}


@pytest.mark.parametrize("case", BAD)
def test_malformed_file_is_one_error_line_in_every_port(capsys, tmp_path, case):
    edit, options, words = BAD[case]
    path = write_gguf(tmp_path / "bad.gguf", "Q8_0", **options)
    if edit is not None:
        edit(path)
    errors = set()
    for framework in PORTS:
        argv = ("generate", "--framework", framework, "--mode", "cached", "--weights", path, "--new-tokens", 2)
        errors.add(assert_one_error_line(*run_cli(capsys, *argv)))
    assert len(errors) == 1
    assert words in errors.pop()
