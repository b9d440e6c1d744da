"""The engine's flags, for the commands that run it (`kvports batch`, `kvports serve`)."""

from __future__ import annotations

import argparse

from kvports.batching.engine import BLOCK_SIZE, MAX_STEP_TOKENS
from kvports.flags import positive_int


def add_engine_arguments(parser: argparse.ArgumentParser, max_batch: int, pool: str) -> None:
    """--max-batch (default `max_batch`), --block-size, --num-blocks (`pool`: what its default holds),
    --max-step-tokens and --no-prefix-cache."""
    parser.add_argument(
        "--max-batch", type=positive_int, default=max_batch, help=f"sequences running at once (default {max_batch})"
    )
    parser.add_argument(
        "--block-size", type=positive_int, default=BLOCK_SIZE, help=f"tokens per KV block (default {BLOCK_SIZE})"
    )
    parser.add_argument(
        "--num-blocks", type=positive_int, default=None, help=f"KV blocks in the pool (default: enough for {pool})"
    )
    parser.add_argument(
        "--max-step-tokens",
        type=positive_int,
        default=MAX_STEP_TOKENS,
        help=f"a prefill step's [batch x tokens] budget, padding included (default {MAX_STEP_TOKENS})",
    )
    parser.add_argument("--no-prefix-cache", action="store_true", help="recompute shared prompt prefixes")
