"""`kvports init-weights`: a randomly initialised weights file. By default the reference port's
initialisation (torch), so seed 0 with the default sizes is the seed's model bit for bit;
`--init numpy` draws GPT-2's initialisation in NumPy and needs no framework at all."""

from __future__ import annotations

import argparse

import numpy as np

from kvports import registry
from kvports.flags import output_file, positive_int, seed
from kvports.formats.weights import DEFAULT_WEIGHTS, gpt2_init_weights, save_weights
from kvports.limits import check_bytes
from kvports.shared.config import STORED_DTYPES, ModelConfig
from kvports.shared.errors import UserError
from kvports.shared.files import check_output_file
from kvports.shared.shapes import parameter_count

HELP = "write a randomly initialised weights file"
SIZES = ("vocab_size", "d_model", "n_heads", "n_layers", "max_seq_len")
INITS = ("torch", "numpy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="the weights file to write")
    parser.add_argument("--seed", type=seed, default=0, help="the initialisation's seed (default 0)")
    defaults = ModelConfig()
    for name in SIZES:
        parser.add_argument("--" + name.replace("_", "-"), type=positive_int, default=getattr(defaults, name))
    parser.add_argument("--dtype", choices=STORED_DTYPES, default="float32")
    parser.add_argument(
        "--init",
        choices=INITS,
        default="torch",
        help="torch (default): PyTorch's own initialisation, which needs torch; seed 0 with the default sizes is "
        "the seed's model, bit for bit. numpy: GPT-2's (normal, std 0.02), NumPy only",
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing file")


def run(args: argparse.Namespace) -> int:
    out = output_file(args.out)
    config = ModelConfig(**{name: getattr(args, name) for name in SIZES}).validate()
    check_output_file(out, args.force, inputs=[DEFAULT_WEIGHTS])  # every command's default --weights
    count = parameter_count(config)
    # torch's float32 initialisation and its NumPy copy, that copy at --dtype, and the file's bytes.
    itemsize = np.dtype(args.dtype).itemsize
    parts = {"initialisation": 2 * count * 4, "tensors": count * itemsize, "file": count * itemsize}
    check_bytes(parts, f"init-weights of {count:,} parameters")
    if args.init == "numpy":
        tensors = gpt2_init_weights(config, args.seed)
    else:
        try:
            port = registry.load_port(registry.REFERENCE)
        except registry.PortUnavailable as exc:
            raise UserError(
                f"init-weights --init torch (the default: the reference initialisation) needs torch: {exc}; "
                "install kvports[torch], or pass --init numpy"
            ) from None
        # init_weights is the reference port's alone, not part of the Port contract.
        tensors = port.init_weights(config, args.seed)  # type: ignore[attr-defined]
    tensors = {name: array.astype(args.dtype, copy=False) for name, array in tensors.items()}
    save_weights(out, tensors, config)
    n_params = sum(array.size for array in tensors.values())
    print(
        f"wrote {out}: {config.family} model, {n_params:,} parameters, {args.dtype}, "
        f"{args.init} initialisation, seed {args.seed}"
    )
    return 0
