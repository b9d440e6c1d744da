"""Text in and out through a local `tokenizer.json` (the `tokenizers` package, imported
only when text is asked for; nothing is fetched)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvports.shared.errors import UserError


def load_tokenizer(path: Path) -> Any:
    """A Hugging Face directory holding tokenizer.json, or the tokenizer.json itself."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UserError("--tokenizer needs the tokenizers package (pip install 'kvports[hf]')") from None
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"no tokenizer.json at {str(path)!r}")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust side raises plain Exception on a malformed file
        raise UserError(f"{str(file)!r} is not a tokenizer.json the tokenizers package can read ({exc})") from None


def encode(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    # Special tokens (a BOS, say) are added as transformers' tokenizer would by default.
    return [tokenizer.encode(text).ids for text in texts]


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
