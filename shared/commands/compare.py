"""`kvports compare`: every framework x mode against a reference, in one table. A framework
that is not installed gets rows that say so; the reference is torch naive, or the first
installed port's naive when torch is missing."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

import numpy as np

from kvports.shared import ports
from kvports.shared.commands.arguments import (
    add_generation_arguments,
    add_input_arguments,
    add_speculative_arguments,
    generation_from,
    load_draft,
    load_inputs,
)
from kvports.shared.commands.generate import describe_generation, timed_generate
from kvports.shared.compare import compare_tokens
from kvports.shared.config import ModelConfig
from kvports.shared.contract import Port
from kvports.shared.errors import UserError
from kvports.shared.families import describe
from kvports.shared.generation import GenerationConfig, row_tokens
from kvports.shared.progress import make_progress

HELP = "every framework x mode against the torch reference, in one table"
EXIT_DISAGREE = 1  # a row disagrees and no float near-tie explains it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_input_arguments(parser)
    add_generation_arguments(parser)
    add_speculative_arguments(parser)


def run(args: argparse.Namespace) -> int:
    config, tensors, prompts = load_inputs(args)
    generation = generation_from(args, config)
    speculative = args.draft is not None  # a speculative row per framework, beside naive and cached
    draft_weights = load_draft(args, config, prompts) if speculative else None
    modes = ("naive", "cached") + (("speculative",) if speculative else ())
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
        task = progress.add_task("compare", total=len(modes) * len(order))
        for name in order:
            port = available[name]
            for mode in modes:
                progress.update(task, description=f"{name} {mode}")
                if port is None:
                    rows.append({"framework": name, "mode": mode, "available": False})
                    progress.advance(task)
                    continue
                model = port.load_model(config, tensors, args.dtype)
                row: dict[str, Any] = {"framework": name, "mode": mode, "available": True}
                if mode == "speculative":
                    draft = None if draft_weights is None else port.load_model(*draft_weights, args.dtype)
                    tokens, counts, first_seconds = timed_speculative(port, model, draft, prompts, generation, args)
                    _, _, seconds = timed_speculative(port, model, draft, prompts, generation, args)
                    results[(name, mode)] = (tokens, None)
                    row["speculative"] = counts
                else:
                    # The first run compiles (JAX) and records logits; the one without logits (a program of
                    # its own in JAX) runs once untimed, then is timed.
                    tokens, logits, first_seconds = timed_generate(port, model, prompts, generation, mode, True)
                    timed_generate(port, model, prompts, generation, mode, False)
                    _, _, seconds = timed_generate(port, model, prompts, generation, mode, False)
                    results[(name, mode)] = (tokens, logits)
                rows.append({**row, "seconds": seconds, "first_call_seconds": first_seconds})
                progress.advance(task)
    ref_tokens, ref_logits = results[(reference, "naive")]
    assert ref_logits is not None  # asked for with return_logits=True
    for row in rows:
        if not row["available"]:
            continue
        tokens, _ = results[(row["framework"], row["mode"])]
        if row["mode"] == "speculative" and not generation.greedy:
            # Speculative sampling draws by its own rule: the reference is the reference's speculative run.
            agreement = compare_tokens(results[(reference, "speculative")][0], tokens, P, None)
        else:
            agreement = compare_tokens(ref_tokens, tokens, P, ref_logits, generation)
        row.update(agreement.as_dict())
        naive = next(r for r in rows if r["framework"] == row["framework"] and r["mode"] == "naive")
        row["cached_speedup"] = naive["seconds"] / row["seconds"] if row["mode"] != "naive" else None
    ok = all(row["explained"] for row in rows if row["available"])
    if args.json:
        print(
            json.dumps(
                {
                    "reference": f"{reference} naive",
                    "family": config.family,
                    "dtype": args.dtype,
                    "generation": dataclasses.asdict(generation),
                    "prompt": row_tokens(prompts),
                    "new_tokens": args.new_tokens,
                    "tokens": row_tokens(ref_tokens),
                    "rows": rows,
                    "ok": ok,
                }
            )
        )
    else:
        print_table(rows, reference, config, args, prompts, generation)
    return 0 if ok else EXIT_DISAGREE


def timed_speculative(
    port: Port, model: Any, draft: Any, prompts: np.ndarray, generation: GenerationConfig, args: argparse.Namespace
) -> tuple[np.ndarray, dict[str, int], float]:
    start = time.perf_counter()
    tokens, counts = port.generate_speculative(model, draft, prompts, generation, args.draft_tokens, args.ngram)
    port.synchronize(model)
    return tokens, counts, time.perf_counter() - start


def print_table(
    rows: list[dict[str, Any]],
    reference: str,
    config: ModelConfig,
    args: argparse.Namespace,
    prompts: np.ndarray,
    generation: GenerationConfig,
) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"kvports compare: {describe(config)}, {prompts.shape[0]} x {prompts.shape[1]}-token prompt, "
        f"{args.new_tokens} new tokens, {describe_generation(generation)}, {args.dtype}; reference: {reference} naive"
    )
    for column in (
        "framework",
        "mode",
        f"vs {reference}",
        "first divergent step",
        "margin there",
        "seconds",
        "speedup vs naive",
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
