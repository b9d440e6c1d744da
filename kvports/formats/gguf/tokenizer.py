"""The tokenizer a GGUF file describes in its metadata (`tokenizer.ggml.*`), built with the
`tokenizers` library as transformers' GGUF loader builds it: byte-level BPE (`model` gpt2)
from the file's tokens and merges, its control tokens special, its user-defined tokens
added whole, the pre-tokenizer's split chosen by `tokenizer.ggml.pre`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvports.formats.gguf.reader import Metadata, is_gguf, open_reader
from kvports.shared.errors import UserError, echo, echo_path

CONTROL, USER_DEFINED = 3, 4  # gguf.TokenType
# Pre-tokenizers whose split differs from GPT-2's byte-level regex (Llama 3's, as transformers
# spells it); any other name splits as GPT-2 does, as transformers does.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS = {"llama3": LLAMA3_SPLIT, "llama-bpe": LLAMA3_SPLIT, "smaug-bpe": LLAMA3_SPLIT}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's bytes -> printable characters (its `bytes_to_unicode`), as the ByteLevel pre-tokenizer
    spells them: printable bytes stand for themselves, the others for code points from 256 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [byte for byte in range(256) if byte not in printable]
    return {**{byte: chr(byte) for byte in printable}, **{byte: chr(256 + n) for n, byte in enumerate(others)}}


def tokenizer_from_metadata(meta: Metadata) -> Any:
    """The file's tokenizer, or one `error:` line naming the key at fault."""
    try:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    except ImportError:
        raise UserError("a GGUF file's text needs the tokenizers package (pip install tokenizers)") from None
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise UserError(f"GGUF file {echo_path(meta.source)} has no tokenizer (no metadata tokenizer.ggml.model)")
    if kind != "gpt2":
        raise meta.refuse("tokenizer.ggml.model", kind, "kvports builds byte-level BPE tokenizers ('gpt2') only")
    tokens = meta.strings("tokenizer.ggml.tokens")
    merges = meta.strings("tokenizer.ggml.merges")
    types = meta.get("tokenizer.ggml.token_type", [])
    if not isinstance(types, list) or len(types) not in (0, len(tokens)):
        raise meta.refuse(
            "tokenizer.ggml.token_type", f"<{len(types)} items>", f"needs one type per token ({len(tokens)})"
        )
    # A token spelled outside the byte alphabet (a control token like <|im_start|> is within it) is respelled
    # byte by byte, as transformers does.
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        key = token if set(token) <= alphabet else "".join(spelling[byte] for byte in token.encode("utf-8"))
        vocab.setdefault(key, index)
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise meta.refuse("tokenizer.ggml.merges", merge, "each merge is two tokens joined by one space")
        pairs.append((parts[0], parts[1]))
    try:
        tokenizer = Tokenizer(
            models.BPE(vocab=vocab, merges=pairs, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
        )
    except Exception as exc:  # the Rust side raises plain Exception on a merge naming no token
        raise UserError(f"GGUF file {echo_path(meta.source)}: its tokenizer cannot be built ({exc})") from None
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    split = SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(prefix, use_regex=False)]
        )
    tokenizer.decoder = decoders.ByteLevel()
    kinds = types or [1] * len(tokens)  # a file without token types: every token normal
    special = [token for token, kind in zip(tokens, kinds, strict=True) if kind == CONTROL and set(token) <= alphabet]
    tokenizer.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in special])
    added = [token for token, kind in zip(tokens, kinds, strict=True) if kind == USER_DEFINED and token in vocab]
    tokenizer.add_tokens([AddedToken(token, normalized=False, special=False) for token in added])
    bos = meta.token_id("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        if bos >= len(tokens):
            raise meta.refuse("tokenizer.ggml.bos_token_id", bos, f"is not a token id below {len(tokens)}")
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)]
        )
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        found = tokenizer.get_vocab_size(with_added_tokens=True)
        raise UserError(
            f"GGUF file {echo_path(meta.source)}: its tokenizer has {found} distinct tokens, not the {len(tokens)} "
            f"it lists (a token repeated: {echo(duplicate(tokens))})"
        )
    return tokenizer


def duplicate(tokens: list[str]) -> str | None:
    seen: set[str] = set()
    for token in tokens:
        if token in seen:
            return token
        seen.add(token)
    return None


def has_tokenizer(path: os.PathLike) -> bool:
    """A GGUF file with a tokenizer in its metadata: its text is decoded without --tokenizer."""
    return is_gguf(path) and "tokenizer.ggml.model" in open_reader(Path(path)).fields


def gguf_tokenizer(path: os.PathLike) -> Any:
    """The tokenizer stored in a GGUF file's metadata (a `tokenizers.Tokenizer`)."""
    return tokenizer_from_metadata(Metadata(open_reader(Path(path)), str(path)))
