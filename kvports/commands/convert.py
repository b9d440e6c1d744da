"""`kvports convert`: a local Hugging Face directory or a GGUF file to our weights file, and our
weights file (or a GGUF file) to a Hugging Face directory (gpt2, llama or mistral).

NumPy only: neither transformers nor torch is needed to convert, and nothing is fetched.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from kvports.families import describe
from kvports.flags import output_file
from kvports.limits import check_bytes
from kvports.shared.config import STORED_DTYPES
from kvports.shared.errors import UserError, echo_path
from kvports.shared.files import check_output_file, check_output_folder

HELP = (
    "convert a local Hugging Face model directory (gpt2, llama, mistral) or a GGUF file to a weights file, "
    "or a weights or GGUF file to a Hugging Face directory"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--from-hf",
        type=Path,
        metavar="DIR",
        help="Hugging Face directory: config.json and *.safetensors (sharded or not)",
    )
    source.add_argument(
        "--from-gguf", type=Path, metavar="FILE", help="a GGUF file (llama), dequantized into our weights file"
    )
    source.add_argument(
        "--to-hf",
        type=Path,
        metavar="FILE",
        help="our weights file or a GGUF file, written as a Hugging Face directory (gpt2, llama or mistral)",
    )
    parser.add_argument(
        "--out",
        help="the weights file (--from-hf, --from-gguf) or directory (--to-hf) to write; a directory is replaced whole",
    )
    parser.add_argument(
        "--tokenizer-out",
        type=Path,
        metavar="DIR",
        help="with --from-gguf, instead of --out: write only the file's tokenizer as a Hugging Face tokenizer "
        "directory (tokenizer.json, tokenizer_config.json with the chat template, bos and eos), e.g. for "
        "lm-eval's tokenizer=DIR",
    )
    parser.add_argument(
        "--dtype",
        choices=STORED_DTYPES,
        default=None,
        help="cast to this dtype (needed for bf16/fp16 checkpoints; default: keep float32/float64)",
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing output")


def run(args: argparse.Namespace) -> int:
    if args.tokenizer_out is not None:
        if args.from_gguf is None or args.out is not None:
            raise UserError("--tokenizer-out goes with --from-gguf FILE, without --out")
        return tokenizer_out(args)
    if args.out is None:
        raise UserError("--out is missing: give the file or directory to write")
    if args.from_gguf is not None:
        return from_gguf(args)
    return from_hf(args) if args.from_hf is not None else to_hf(args)


def from_hf(args: argparse.Namespace) -> int:
    from kvports.formats.hf.importer import import_hf
    from kvports.formats.weights import save_weights

    out = output_file(args.out)
    check_output_file(out, args.force, inputs=[args.from_hf])
    config, tensors = import_hf(args.from_hf, args.dtype)
    save_weights(out, tensors, config)
    n_params = sum(array.size for array in tensors.values())
    dtype = next(iter(tensors.values())).dtype
    print(f"wrote {out}: {describe(config)}, {n_params:,} parameters, {dtype}, from {args.from_hf}")
    write_text_files(args.from_hf, out.parent, args.force)
    return 0


def from_gguf(args: argparse.Namespace) -> int:
    from kvports.formats.weights import GGUFWeights, save_weights
    from kvports.shared.shapes import parameter_count

    out = output_file(args.out)
    check_output_file(out, args.force, inputs=[args.from_gguf])
    with GGUFWeights(args.from_gguf) as weights:
        config = weights.config
        dtype = args.dtype if args.dtype is not None else weights.dtype
        count = parameter_count(config)
        # The dequantized tensors (float32), their cast, and the file's bytes made from them.
        parts = {"dequantized": count * 4, "tensors": count * np.dtype(dtype).itemsize}
        check_bytes({**parts, "file": parts["tensors"]}, f"dequantizing {echo_path(args.from_gguf)} to {dtype}")
        tensors = weights.read(dtype)
    save_weights(out, tensors, config)
    print(f"wrote {out}: {describe(config)}, {count:,} parameters, {dtype}, dequantized from {args.from_gguf}")
    write_text_files(args.from_gguf, out.parent, args.force)
    return 0


def tokenizer_out(args: argparse.Namespace) -> int:
    """A GGUF file's tokenizer alone as a Hugging Face tokenizer directory (AutoTokenizer loads it)."""
    from kvports.shared.files import write_atomic

    out = args.tokenizer_out
    check_output_folder(out, args.force, inputs=[args.from_gguf])
    files = text_files(args.from_gguf)
    if not files:
        raise UserError(f"{echo_path(args.from_gguf)} holds no tokenizer (tokenizer.ggml.model)")
    out.mkdir(parents=True, exist_ok=True)
    for name, payload in files.items():
        write_atomic(out / name, payload)
    print(f"wrote {out}: {', '.join(files)}, the tokenizer of {args.from_gguf}")
    return 0


def text_files(source: Path) -> dict[str, bytes]:
    """The weights' tokenizer (tokenizer.json) and chat template (tokenizer_config.json, as Hugging
    Face keeps it) to write beside a conversion: a GGUF file's own, or those beside the source."""
    from kvports.formats.chat import TOKENIZER_CONFIG
    from kvports.formats.gguf.reader import is_gguf
    from kvports.formats.gguf.tokenizer import gguf_text
    from kvports.loading import tokenizer_beside

    if not is_gguf(source):
        folder = source if source.is_dir() else source.parent
        beside = [name for name in ("tokenizer.json", TOKENIZER_CONFIG) if (folder / name).is_file()]
        return {} if tokenizer_beside(source) is None else {name: (folder / name).read_bytes() for name in beside}
    text = gguf_text(source)
    if text.tokenizer is None:
        return {}
    files = {"tokenizer.json": text.tokenizer.encode()}
    if text.template is not None:
        # tokenizer_class: AutoTokenizer loads the folder without a config.json (a --tokenizer-out folder).
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": text.template, **text.special}
        files[TOKENIZER_CONFIG] = json.dumps(settings, indent=2).encode()
    return files


def write_text_files(source: Path, folder: Path, force: bool) -> None:
    """The tokenizer and chat template beside the converted weights, so --text and --chat work on them."""
    from kvports.shared.files import write_atomic

    files = text_files(source)
    for name in files:
        check_output_file(folder / name, force, inputs=[source])
    for name, payload in files.items():
        write_atomic(folder / name, payload)
    if files:
        print(f"wrote {', '.join(files)} beside it: the tokenizer and chat template, for --text and --chat")


def to_hf(args: argparse.Namespace) -> int:
    from kvports.formats.hf.exporter import export_hf, hf_refusal
    from kvports.formats.weights import open_weights
    from kvports.shared.shapes import parameter_count

    out = Path(args.out)
    check_output_folder(out, args.force, inputs=[args.to_hf])
    with open_weights(args.to_hf) as weights:
        config = weights.config
        why = hf_refusal(config)  # before anything is read or written
        if why is not None:
            raise UserError(f"cannot write {echo_path(args.to_hf)} as a Hugging Face model: {why}")
        dtype = args.dtype if args.dtype is not None else weights.dtype
        size = parameter_count(config) * np.dtype(dtype).itemsize
        # The tensors, and the file's bytes made from them before it is written.
        check_bytes({"tensors": size, "file": size}, f"writing {echo_path(args.to_hf)} in {dtype}")
        tensors = weights.read(dtype)  # finite at the dtype written, or refused
    model_type = export_hf(config, tensors, out)
    print(f"wrote {out}: {model_type}-type directory (config.json, model.safetensors) of a {describe(config)}, {dtype}")
    write_text_files(args.to_hf, out, force=True)  # inside the folder just written
    return 0
