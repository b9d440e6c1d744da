"""Text in and out through a local `tokenizer.json` (the `tokenizers` package, imported
only when text is asked for; nothing is fetched)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvports.formats.hf.checkpoint import MAX_TOKENIZER_BYTES, check_file_size
from kvports.shared.errors import UserError, echo, echo_path


def load_tokenizer(path: Path) -> Any:
    """A Hugging Face directory holding tokenizer.json, or the tokenizer.json itself."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UserError("--tokenizer needs the tokenizers package (pip install 'kvports[hf]')") from None
    try:
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise UserError(f"no tokenizer.json at {echo_path(path)}")
    except OSError as exc:  # a name too long, say
        raise UserError(f"cannot read {echo_path(path)} ({exc.strerror or exc})") from None
    check_file_size(file, "tokenizer file", MAX_TOKENIZER_BYTES)  # the Rust side would read any size whole
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust side raises plain Exception on a malformed file
        raise UserError(f"{echo_path(file)} is not a tokenizer.json the tokenizers package can read ({exc})") from None


def check_vocabulary(tokenizer: Any, vocab_size: int) -> Any:
    """The tokenizer, if it has a token for every id the model can emit: decode drops an id it
    does not know without a word, so a smaller tokenizer would lose generated tokens."""
    known = {index for index in tokenizer.get_vocab(with_added_tokens=True).values() if 0 <= index < vocab_size}
    if len(known) < vocab_size:
        missing = next(index for index in range(vocab_size) if index not in known)
        raise UserError(
            f"the tokenizer has no token for id {missing} (it knows {len(known)} of the model's vocab_size "
            f"{vocab_size}): its text would silently drop such ids; give the model's own tokenizer"
        )
    return tokenizer


def encode(tokenizer: Any, texts: Sequence[str], what: str = "--text") -> list[list[int]]:
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # bytes the shell passed that are not UTF-8 (surrogate-escaped by Python)
            raise UserError(f"{what} {echo(text)} is not valid UTF-8") from None
    # Special tokens (a BOS, say) are added as transformers' tokenizer would by default.
    return [tokenizer.encode(text).ids for text in texts]


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def decode_answer(tokenizer: Any, ids: Sequence[int]) -> str:
    """What a row generated, as a reader wants it: special tokens (a stop token, an end of turn) left out."""
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)
