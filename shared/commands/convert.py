"""`kvports convert`: a local Hugging Face directory to our weights file, and back to gpt2.

NumPy only: neither transformers nor torch is needed to convert, and nothing is fetched.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvports.shared.config import DTYPES
from kvports.shared.errors import UserError
from kvports.shared.families import describe

HELP = (
    "convert a local Hugging Face model directory (gpt2, llama, mistral) to a weights file, or a weights file to gpt2"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--from-hf",
        type=Path,
        metavar="DIR",
        help="Hugging Face directory: config.json and *.safetensors (sharded or not)",
    )
    source.add_argument("--to-hf", type=Path, metavar="FILE", help="our weights file, written as a gpt2-type directory")
    parser.add_argument(
        "--out", type=Path, required=True, help="the weights file (--from-hf) or directory (--to-hf) to write"
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="cast to this dtype (needed for bf16/fp16 checkpoints; default: keep float32/float64)",
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing output")


def run(args: argparse.Namespace) -> int:
    return from_hf(args) if args.from_hf is not None else to_hf(args)


def from_hf(args: argparse.Namespace) -> int:
    from kvports.shared.hf.importer import import_hf
    from kvports.shared.weights import save_weights

    out: Path = args.out
    if out.exists() and not args.force:
        raise UserError(f"{str(out)!r} exists; pass --force to overwrite it")
    if out.is_dir():
        raise UserError(f"{str(out)!r} is a folder; --out names the weights file to write")
    if not out.parent.is_dir():
        raise UserError(f"folder {str(out.parent)!r} does not exist")
    config, tensors = import_hf(args.from_hf, args.dtype)
    save_weights(out, tensors, config)
    n_params = sum(array.size for array in tensors.values())
    dtype = next(iter(tensors.values())).dtype
    print(f"wrote {out}: {describe(config)}, {n_params:,} parameters, {dtype}, from {args.from_hf}")
    return 0


def to_hf(args: argparse.Namespace) -> int:
    from kvports.shared.hf.config import gpt2_refusal
    from kvports.shared.hf.exporter import export_gpt2
    from kvports.shared.weights import load_weights

    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise UserError(f"{str(out)!r} is a file; --out names the directory to write")
    if out.is_dir() and any((out / name).exists() for name in ("config.json", "model.safetensors")) and not args.force:
        raise UserError(f"{str(out)!r} already holds a model; pass --force to overwrite it")
    if not out.parent.is_dir():
        raise UserError(f"folder {str(out.parent)!r} does not exist")
    config, tensors = load_weights(args.to_hf)
    why = gpt2_refusal(config)  # before anything is written
    if why is not None:
        raise UserError(f"cannot write {str(args.to_hf)!r} as gpt2: {why}")
    if args.dtype is not None:
        tensors = {name: array.astype(args.dtype) for name, array in tensors.items()}
    export_gpt2(config, tensors, out)
    dtype = next(iter(tensors.values())).dtype
    print(f"wrote {out}: gpt2-type directory (config.json, model.safetensors) of a {describe(config)}, {dtype}")
    return 0
