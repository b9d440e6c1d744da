"""The `kvports` command line. Imports only NumPy at start; ports load by name.

Every user error is one line on stderr, `error: ...`, exit status 2, nothing on
stdout, the same whichever framework was asked for, raised before any port runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from kvports.shared.checks import SEED_PROMPT, check_prompts, parse_prompt
from kvports.shared.config import DTYPES, ModelConfig
from kvports.shared.errors import UserError
from kvports.shared.families import describe
from kvports.shared.ports import PORTS, REFERENCE, PortUnavailable, available_port, load_port
from kvports.shared.weights import DEFAULT_WEIGHTS, load_weights, save_weights

EXIT_USAGE = 2
EXIT_DISAGREE = 1


def positive_int(text: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None


def add_input_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--weights", type=Path, default=None,
                        help="safetensors weights file (default: the seed's model, shipped with kvports)")
    parser.add_argument("--prompt", action="append", default=None, metavar="IDS",
                        help="comma-separated token ids; repeat for a batch of equal-length prompts "
                             f"(default: {','.join(map(str, SEED_PROMPT))})")
    parser.add_argument("--new-tokens", type=positive_int, default=100, metavar="N", help="tokens to generate (default 100)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype (default float32)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def add_text_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--text", action="append", default=None,
                        help="prompt text, encoded with --tokenizer; repeat for a batch (equal token counts)")
    parser.add_argument("--tokenizer", type=Path, default=None, metavar="DIR",
                        help="folder holding tokenizer.json (e.g. the Hugging Face directory converted with --from-hf)")


def load_inputs(args: argparse.Namespace):
    """Weights and prompts, checked: everything a port needs, before any port is imported."""
    config, tensors = load_weights(args.weights if args.weights is not None else DEFAULT_WEIGHTS)
    if getattr(args, "text", None) is not None:
        from kvports.shared.text import encode

        if args.prompt:
            raise UserError("give --prompt (token ids) or --text, not both")
        ids = encode(load_text_tokenizer(args), args.text)
        prompts = check_prompts(ids, config, args.new_tokens)
    else:
        texts = args.prompt if args.prompt else [",".join(map(str, SEED_PROMPT))]
        prompts = check_prompts([parse_prompt(text) for text in texts], config, args.new_tokens)
    return config, tensors, prompts


def load_text_tokenizer(args: argparse.Namespace):
    """The tokenizer --text and decoded output need; None when neither was asked for."""
    if getattr(args, "tokenizer", None) is None:
        if getattr(args, "text", None) is not None:
            raise UserError("--text needs --tokenizer DIR (a folder holding tokenizer.json)")
        return None
    if not hasattr(args, "_tokenizer"):
        from kvports.shared.text import load_tokenizer

        args._tokenizer = load_tokenizer(args.tokenizer)
    return args._tokenizer


def timed_generate(port, model, prompts: np.ndarray, new_tokens: int, mode: str, return_logits: bool):
    start = time.perf_counter()
    tokens, logits = port.generate(model, prompts, new_tokens, mode, return_logits=return_logits)
    port.synchronize(model)
    return tokens, logits, time.perf_counter() - start


def cmd_generate(args: argparse.Namespace) -> int:
    config, tensors, prompts = load_inputs(args)
    tokenizer = load_text_tokenizer(args)
    try:
        port = load_port(args.framework)
    except PortUnavailable as exc:
        raise UserError(str(exc)) from None
    model = port.load_model(config, tensors, args.dtype)
    tokens, _, seconds = timed_generate(port, model, prompts, args.new_tokens, args.mode, False)
    texts = None
    if tokenizer is not None:
        from kvports.shared.text import decode

        texts = [decode(tokenizer, row) for row in tokens]
    if args.json:
        result = {"framework": args.framework, "mode": args.mode, "dtype": args.dtype, "family": config.family,
                  "tokens": tokens.tolist(), "seconds": seconds}
        if texts is not None:
            result["text"] = texts
        print(json.dumps(result))
        return 0
    P = prompts.shape[1]
    print(f"{args.framework} {args.mode} {args.dtype}, {describe(config)}, {args.new_tokens} new tokens in {seconds:.3f} s")
    for index, (row, prompt) in enumerate(zip(tokens, prompts)):
        print(f"  prompt    {' '.join(map(str, prompt))}")
        print(f"  generated {' '.join(map(str, row[P:]))}")
        if texts is not None:
            print(f"  text      {texts[index]}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from kvports.shared.compare import compare_tokens

    config, tensors, prompts = load_inputs(args)
    P = prompts.shape[1]
    ports = {name: available_port(name) for name in PORTS}
    reference = REFERENCE if ports[REFERENCE] is not None else next((n for n in PORTS if ports[n] is not None), None)
    if reference is None:
        raise UserError("no framework is installed: install kvports[torch], kvports[jax] or use numpy")
    order = [reference] + [name for name in PORTS if name != reference]
    rows, results = [], {}
    progress = make_progress(args.json)
    with progress:
        task = progress.add_task("compare", total=2 * len(order))
        for name in order:
            port = ports[name]
            for mode in ("naive", "cached"):
                progress.update(task, description=f"{name} {mode}")
                if port is None:
                    rows.append({"framework": name, "mode": mode, "available": False})
                    progress.advance(task)
                    continue
                model = port.load_model(config, tensors, args.dtype)
                # The first run compiles (JAX) and records logits; the second is timed.
                tokens, logits, first_seconds = timed_generate(port, model, prompts, args.new_tokens, mode, True)
                _, _, seconds = timed_generate(port, model, prompts, args.new_tokens, mode, False)
                results[(name, mode)] = (tokens, logits)
                rows.append({"framework": name, "mode": mode, "available": True, "seconds": seconds,
                             "first_call_seconds": first_seconds})
                progress.advance(task)
    ref_tokens, ref_logits = results[(reference, "naive")]
    for row in rows:
        if not row["available"]:
            continue
        tokens, _ = results[(row["framework"], row["mode"])]
        row.update(compare_tokens(ref_tokens, tokens, P, ref_logits).as_dict())
        naive = next(r for r in rows if r["framework"] == row["framework"] and r["mode"] == "naive")
        row["cached_speedup"] = naive["seconds"] / row["seconds"] if row["mode"] == "cached" else None
    ok = all(row["explained"] for row in rows if row["available"])
    if args.json:
        print(json.dumps({"reference": f"{reference} naive", "family": config.family, "dtype": args.dtype,
                          "prompt": prompts.tolist(), "new_tokens": args.new_tokens,
                          "tokens": ref_tokens.tolist(), "rows": rows, "ok": ok}))
    else:
        print_compare_table(rows, reference, config, args, prompts)
    return 0 if ok else EXIT_DISAGREE


def make_progress(quiet: bool):
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    return Progress(TextColumn("{task.description:<14}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(), console=console, transient=True, disable=quiet or not console.is_terminal)


def print_compare_table(rows: List[dict], reference: str, config: ModelConfig, args, prompts: np.ndarray) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvports compare: {describe(config)}, {prompts.shape[0]} x {prompts.shape[1]}-token prompt, "
                        f"{args.new_tokens} new tokens, {args.dtype}; reference: {reference} naive")
    for column in ("framework", "mode", f"vs {reference}", "first divergent step", "top-2 margin there", "seconds", "cached speedup"):
        table.add_column(column, justify="left" if column in ("framework", "mode") else "right")
    for row in rows:
        if not row["available"]:
            table.add_row(row["framework"], row["mode"], "not installed", "-", "-", "-", "-")
            continue
        verdict = "agrees" if row["agree"] else ("near-tie" if row["explained"] else "DISAGREES")
        step = "-" if row["first_divergent_step"] is None else str(row["first_divergent_step"])
        margin = "-" if row["reference_margin"] is None else f"{row['reference_margin']:.2e}"
        speedup = "-" if row["cached_speedup"] is None else f"{row['cached_speedup']:.1f}x"
        table.add_row(row["framework"], row["mode"], verdict, step, margin, f"{row['seconds']:.4f}", speedup)
    Console(width=max(120, Console().width)).print(table)


def cmd_init_weights(args: argparse.Namespace) -> int:
    fields = {name: getattr(args, name) for name in ("vocab_size", "d_model", "n_heads", "n_layers", "max_seq_len")}
    config = ModelConfig(**fields).validate()
    if args.out.exists() and not args.force:
        raise UserError(f"{str(args.out)!r} exists; pass --force to overwrite it")
    if not args.out.parent.is_dir():
        raise UserError(f"folder {str(args.out.parent)!r} does not exist")
    try:
        port = load_port(REFERENCE)
    except PortUnavailable as exc:
        raise UserError(f"init-weights uses the reference initialisation: {exc}") from None
    tensors = port.init_weights(config, args.seed)
    tensors = {name: array.astype(args.dtype) for name, array in tensors.items()}
    save_weights(args.out, tensors, config)
    n_params = sum(array.size for array in tensors.values())
    print(f"wrote {args.out}: {config.family} model, {n_params:,} parameters, {args.dtype}, seed {args.seed}")
    return 0


# Further subcommands live in their own NumPy-only modules, each with HELP,
# add_arguments(parser) and run(args); heavy imports happen inside run().
SUBCOMMAND_MODULES: tuple = ("kvports.shared.convert", "kvports.shared.bench", "kvports.shared.batching.batch")


def extra_subcommands() -> List[tuple]:
    import importlib

    commands = []
    for module_name in SUBCOMMAND_MODULES:
        module = importlib.import_module(module_name)
        commands.append((module_name.rsplit(".", 1)[-1].replace("_", "-"), module.HELP, module.add_arguments, module.run))
    return commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvports", description="Naive vs KV-cached generation of one decoder, in PyTorch, JAX/Flax and NumPy.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = sub.add_parser("generate", help="greedy generation with one framework and mode")
    generate.add_argument("--framework", choices=PORTS, required=True)
    generate.add_argument("--mode", choices=("naive", "cached"), required=True)
    add_input_arguments(generate)
    add_text_arguments(generate)
    generate.set_defaults(run=cmd_generate)

    compare = sub.add_parser("compare", help="every framework x mode against the torch reference, in one table")
    add_input_arguments(compare)
    compare.set_defaults(run=cmd_compare)

    init = sub.add_parser("init-weights", help="write a randomly initialised weights file")
    init.add_argument("--out", type=Path, required=True)
    init.add_argument("--seed", type=positive_int, default=0)
    defaults = ModelConfig()
    for name in ("vocab_size", "d_model", "n_heads", "n_layers", "max_seq_len"):
        init.add_argument("--" + name.replace("_", "-"), type=positive_int, default=getattr(defaults, name))
    init.add_argument("--dtype", choices=DTYPES, default="float32")
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    init.set_defaults(run=cmd_init_weights)

    for name, help_text, add_arguments, run in extra_subcommands():
        command = sub.add_parser(name, help=help_text)
        add_arguments(command)
        command.set_defaults(run=run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
