"""`kvports compare`: every framework x mode against a reference, in one table. A framework
that is not installed gets rows that say so; the reference is torch naive, or the first
installed port's naive when torch is missing."""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from kvports.shared import ports
from kvports.shared.commands.arguments import add_input_arguments, load_inputs
from kvports.shared.commands.generate import timed_generate
from kvports.shared.compare import compare_tokens
from kvports.shared.config import ModelConfig
from kvports.shared.contract import Port
from kvports.shared.errors import UserError
from kvports.shared.families import describe
from kvports.shared.progress import make_progress

HELP = "every framework x mode against the torch reference, in one table"
EXIT_DISAGREE = 1  # a row disagrees and no float near-tie explains it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_input_arguments(parser)


def run(args: argparse.Namespace) -> int:
    config, tensors, prompts = load_inputs(args)
    P = prompts.shape[1]
    available: dict[str, Port | None] = {name: ports.available_port(name) for name in ports.PORTS}
    installed = [name for name in ports.PORTS if available[name] is not None]
    if not installed:
        raise UserError("no framework is installed: install kvports[torch], kvports[jax] or use numpy")
    reference = ports.REFERENCE if ports.REFERENCE in installed else installed[0]
    order = [reference] + [name for name in ports.PORTS if name != reference]
    rows: list[dict[str, Any]] = []
    results: dict[tuple[str, str], tuple[np.ndarray, np.ndarray | None]] = {}
    with make_progress(args.json) as progress:
        task = progress.add_task("compare", total=2 * len(order))
        for name in order:
            port = available[name]
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
                rows.append(
                    {
                        "framework": name,
                        "mode": mode,
                        "available": True,
                        "seconds": seconds,
                        "first_call_seconds": first_seconds,
                    }
                )
                progress.advance(task)
    ref_tokens, ref_logits = results[(reference, "naive")]
    assert ref_logits is not None  # asked for with return_logits=True
    for row in rows:
        if not row["available"]:
            continue
        tokens, _ = results[(row["framework"], row["mode"])]
        row.update(compare_tokens(ref_tokens, tokens, P, ref_logits).as_dict())
        naive = next(r for r in rows if r["framework"] == row["framework"] and r["mode"] == "naive")
        row["cached_speedup"] = naive["seconds"] / row["seconds"] if row["mode"] == "cached" else None
    ok = all(row["explained"] for row in rows if row["available"])
    if args.json:
        print(
            json.dumps(
                {
                    "reference": f"{reference} naive",
                    "family": config.family,
                    "dtype": args.dtype,
                    "prompt": prompts.tolist(),
                    "new_tokens": args.new_tokens,
                    "tokens": ref_tokens.tolist(),
                    "rows": rows,
                    "ok": ok,
                }
            )
        )
    else:
        print_table(rows, reference, config, args, prompts)
    return 0 if ok else EXIT_DISAGREE


def print_table(
    rows: list[dict[str, Any]], reference: str, config: ModelConfig, args: argparse.Namespace, prompts: np.ndarray
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"kvports compare: {describe(config)}, {prompts.shape[0]} x {prompts.shape[1]}-token prompt, "
        f"{args.new_tokens} new tokens, {args.dtype}; reference: {reference} naive"
    )
    for column in (
        "framework",
        "mode",
        f"vs {reference}",
        "first divergent step",
        "top-2 margin there",
        "seconds",
        "cached speedup",
    ):
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
