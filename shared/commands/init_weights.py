"""`kvports init-weights`: a randomly initialised weights file, by the reference port's
initialisation (torch), so seed 0 with the default sizes is the seed's model bit for bit."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvports.shared import ports
from kvports.shared.commands.arguments import non_negative_int, positive_int
from kvports.shared.config import DTYPES, ModelConfig
from kvports.shared.errors import UserError
from kvports.shared.weights import save_weights

HELP = "write a randomly initialised weights file"
SIZES = ("vocab_size", "d_model", "n_heads", "n_layers", "max_seq_len")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=non_negative_int, default=0)
    defaults = ModelConfig()
    for name in SIZES:
        parser.add_argument("--" + name.replace("_", "-"), type=positive_int, default=getattr(defaults, name))
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")


def run(args: argparse.Namespace) -> int:
    config = ModelConfig(**{name: getattr(args, name) for name in SIZES}).validate()
    if args.out.exists() and not args.force:
        raise UserError(f"{str(args.out)!r} exists; pass --force to overwrite it")
    if not args.out.parent.is_dir():
        raise UserError(f"folder {str(args.out.parent)!r} does not exist")
    try:
        port = ports.load_port(ports.REFERENCE)
    except ports.PortUnavailable as exc:
        raise UserError(f"init-weights uses the reference initialisation: {exc}") from None
    # init_weights is the reference port's alone, not part of the Port contract.
    tensors = port.init_weights(config, args.seed)  # type: ignore[attr-defined]
    tensors = {name: array.astype(args.dtype) for name, array in tensors.items()}
    save_weights(args.out, tensors, config)
    n_params = sum(array.size for array in tensors.values())
    print(f"wrote {args.out}: {config.family} model, {n_params:,} parameters, {args.dtype}, seed {args.seed}")
    return 0
