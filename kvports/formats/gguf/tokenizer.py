"""The tokenizer a GGUF file describes in its metadata (`tokenizer.ggml.*`), built with the
`tokenizers` library as transformers' GGUF loader builds it: byte-level BPE (`model` gpt2)
from the file's tokens and merges, its control tokens special, its user-defined tokens
added whole, the pre-tokenizer's split chosen by `tokenizer.ggml.pre`. The token and merge
lists are read whole from the reader's view of the file, not item by item; what is built is
kept in the load cache (`formats.gguf.cache`), so a later load reads tokenizer.json instead."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from kvports.formats.gguf.reader import Metadata, is_gguf, open_reader
from kvports.shared.errors import UserError, echo, echo_path

if TYPE_CHECKING:
    from kvports.formats.gguf.cache import Text

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
    tokens = strings(meta, "tokenizer.ggml.tokens")
    merges = strings(meta, "tokenizer.ggml.merges")
    types = numbers(meta, "tokenizer.ggml.token_type")
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


def array_bytes(meta: Metadata, key: str, item: int) -> tuple[bytes, int] | None:
    """A metadata array's items as the bytes the file holds them in, one view of the mapped file
    (the reader splits them into a NumPy view per item: reading those one by one took seconds),
    and their count; None for a key the file lacks or an empty array, a refusal for one not an
    array of `item`."""
    from gguf import GGUFValueType

    field = meta.reader.fields.get(key)
    if field is None:
        return None
    if field.types[:1] != [GGUFValueType.ARRAY] or not field.data:
        return None if field.types[:1] == [GGUFValueType.ARRAY] else refuse_type(meta, key, field, item)
    if field.types[1:] != [item]:
        refuse_type(meta, key, field, item)
    # field.data indexes each item's part; a string's length is the part before it
    first = field.parts[field.data[0] - (item == GGUFValueType.STRING)]
    last = field.parts[field.data[-1]]
    data = meta.reader.data  # [bytes]: the mapped file
    start = first.ctypes.data - data.ctypes.data
    end = last.ctypes.data + last.nbytes - data.ctypes.data
    return data[start:end].tobytes(), len(field.data)


def refuse_type(meta: Metadata, key: str, field: Any, item: Any) -> NoReturn:
    kinds = " of ".join(kind.name for kind in field.types)
    raise meta.refuse(key, f"<{kinds}>", f"must be a list of {item.name.lower()}s")


def strings(meta: Metadata, key: str) -> list[str]:
    """A metadata array of strings ([]: the file lacks it), each its 8-byte length then its UTF-8 bytes."""
    from gguf import GGUFValueType

    found = array_bytes(meta, key, GGUFValueType.STRING)
    if found is None:
        return []
    blob, count = found
    items, offset, length = [], 0, struct.Struct("<Q")
    try:
        for _ in range(count):
            (size,) = length.unpack_from(blob, offset)
            items.append(blob[offset + 8 : offset + 8 + size].decode("utf-8"))
            offset += 8 + size
    except UnicodeDecodeError:
        raise meta.refuse(key, f"<item {len(items)}>", "is not UTF-8") from None
    return items


def numbers(meta: Metadata, key: str) -> list[int]:
    """A metadata array of 32-bit integers, as GGUF stores token types ([]: the file lacks it)."""
    from gguf import GGUFValueType

    field = meta.reader.fields.get(key)
    kind = field.types[-1] if field is not None and field.types else GGUFValueType.INT32
    if kind not in (GGUFValueType.INT32, GGUFValueType.UINT32):
        raise meta.refuse(key, f"<{kind.name}>", "must be an array of 32-bit integers")
    found = array_bytes(meta, key, kind)
    if found is None:
        return []
    return np.frombuffer(found[0], dtype="<i4" if kind == GGUFValueType.INT32 else "<u4").tolist()


def read_text(path: Path) -> Text:
    """What a GGUF file's metadata says of its text: its tokenizer (as tokenizer.json), chat
    template and bos_token / eos_token strings. The load cache keeps it (`gguf_text`)."""
    from kvports.formats.gguf.cache import Text

    meta = Metadata(open_reader(path), str(path))
    tokenizer = tokenizer_from_metadata(meta).to_str() if "tokenizer.ggml.model" in meta else None
    try:
        template, problem = meta.get("tokenizer.chat_template"), None
    except UnicodeDecodeError:
        template, problem = None, "is not UTF-8 text"
    tokens = strings(meta, "tokenizer.ggml.tokens")
    special = {}
    for name in ("bos", "eos"):
        index = meta.token_id(f"tokenizer.ggml.{name}_token_id")
        if index is not None and index < len(tokens):
            special[f"{name}_token"] = tokens[index]
    context = meta.get("llama.context_length")
    return Text(
        tokenizer,
        template if isinstance(template, str) else None,
        special,
        context if isinstance(context, int) and not isinstance(context, bool) else None,
        problem,
    )


def gguf_text(path: os.PathLike) -> Text:
    """A GGUF file's text side (tokenizer, chat template, special strings), through the load cache."""
    from kvports.formats.gguf.cache import kept_text

    return kept_text(path, read_text)


def has_tokenizer(path: os.PathLike) -> bool:
    """A GGUF file with a tokenizer in its metadata: its text is decoded without --tokenizer."""
    return is_gguf(path) and gguf_text(path).tokenizer is not None


def gguf_tokenizer(path: os.PathLike) -> Any:
    """The tokenizer stored in a GGUF file's metadata (a `tokenizers.Tokenizer`)."""
    text = gguf_text(path)
    if text.tokenizer is None:  # the build's own message names the missing key
        return tokenizer_from_metadata(Metadata(open_reader(Path(path)), str(path)))
    return text.load_tokenizer()
