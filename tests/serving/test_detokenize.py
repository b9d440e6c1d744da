"""A choice's text as it streams (`kvports.server.detokenize`): decoded a token at a time without
ever splitting a multi-byte character, and cut before a stop string, even one that arrives in pieces."""

from __future__ import annotations

import pytest

from kvports.formats.gguf.tokenizer import gguf_tokenizer
from kvports.server.detokenize import Detokenizer

TEXT = "naïve café 東京 🙂 hello world"
EOS = 2  # the tiny chat model's <|im_end|>


@pytest.fixture(scope="module")
def tokenizer(chat_model):
    return gguf_tokenizer(chat_model)


def pieces(tokenizer, ids, stop=()) -> tuple[list[str], Detokenizer]:
    detokenizer = Detokenizer(tokenizer, stop, [EOS])
    out = [detokenizer.add([token]) for token in ids]
    return [*out, detokenizer.finish()], detokenizer


def test_each_piece_is_whole_characters_and_together_the_text(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    assert len(ids) > len(TEXT.encode()) // 2  # byte-level: the CJK and the emoji take several tokens each
    out, _ = pieces(tokenizer, ids)
    assert "".join(out) == TEXT
    assert all("\ufffd" not in piece for piece in out)  # no piece ends inside a character


def test_a_stop_id_adds_no_text(tokenizer):
    ids = tokenizer.encode("hello", add_special_tokens=False).ids
    out, detokenizer = pieces(tokenizer, [*ids, EOS])
    assert "".join(out) == "hello" and detokenizer.tokens == len(ids) + 1


def test_the_text_ends_before_a_stop_string_that_arrives_in_pieces(tokenizer):
    ids = tokenizer.encode("hello world, hello", add_special_tokens=False).ids
    out, detokenizer = pieces(tokenizer, ids, stop=["o wor"])
    assert "".join(out) == "hell"
    assert detokenizer.stopped
    assert "".join(out[: detokenizer.tokens]) == "hell"  # nothing after the token that completed it


def test_text_that_may_begin_a_stop_string_is_held_back_until_it_cannot(tokenizer):
    ids = tokenizer.encode("hello", add_special_tokens=False).ids
    detokenizer = Detokenizer(tokenizer, ["lox"], [EOS])
    sent = "".join(detokenizer.add([token]) for token in ids)
    assert sent == "hel"[: len(sent)] and not sent.endswith("lo")  # "lo" could still become "lox"
    assert sent + detokenizer.finish() == "hello"
