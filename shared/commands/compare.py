"""`kvports compare`: every framework x mode against a reference, in one table: do the tokens
agree (and where they part, was it a float near-tie), how far apart are the logits, and how long
each took. A framework that is not installed (or, with --device gpu, finds no GPU) gets rows that
say so; the reference is torch naive, or the first usable port's naive when torch is not usable.

Logits are compared up to each row's first divergence: after it the histories differ. With
--teacher-forced every port is also fed the reference's tokens (`forward_chunks`: one chunk for
naive, the prompt then one token at a time for cached), so every step is compared, near-tie or not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import numpy as np

from kvports.shared import ports
from kvports.shared.arguments import add_speculative_arguments, positive_int
from kvports.shared.checks import missing_precision
from kvports.shared.commands.arguments import (
    add_generation_arguments,
    add_input_arguments,
    add_text_arguments,
    read_inputs,
    warn_unused,
)
from kvports.shared.commands.generate import describe_generation
from kvports.shared.compare import NEAR_TIE, comparable_steps, compare_tokens, logit_difference
from kvports.shared.config import ModelConfig
from kvports.shared.contract import Port
from kvports.shared.devices import add_device_argument, check_gpu_reachable, device_problem, placement
from kvports.shared.errors import UserError
from kvports.shared.families import describe
from kvports.shared.generation import PAD, GenerationConfig, row_tokens
from kvports.shared.limits import check_count
from kvports.shared.progress import make_progress
from kvports.shared.quant import float_tensors
from kvports.shared.run import LoadedModel, RunInputs, draft_model, run_port, timed
from kvports.shared.terminal import console_for

HELP = "every framework x mode against the torch reference: tokens, logit differences, time"
EXIT_DISAGREE = 1  # a row disagrees and no float near-tie explains it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_input_arguments(parser)
    add_device_argument(parser)
    add_text_arguments(parser)  # --text and --chat prompts (a GGUF file's own tokenizer, or --tokenizer)
    parser.add_argument(
        "--teacher-forced",
        action="store_true",
        help="also feed every port the reference's tokens and compare the logits at every step, past any divergence",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        metavar="R",
        help="timed runs per row after a warm-up; seconds are their median (default 3)",
    )
    add_generation_arguments(parser)
    add_speculative_arguments(parser)


def usable_ports(device: str) -> tuple[dict[str, Port | None], dict[str, str]]:
    """Each framework's port, or None with the reason it cannot run (not installed, no GPU)."""
    usable: dict[str, Port | None] = {}
    reasons: dict[str, str] = {}
    problems: dict[str, str | None] = {}
    for name in ports.PORTS:
        port = ports.available_port(name)
        problem = "not installed" if port is None else device_problem(port, device)
        problems[name] = problem
        usable[name] = None if problem is not None else port
        if problem is not None:
            reasons[name] = problem
    if not any(usable.values()):
        if device == "cpu":
            raise UserError("no framework is installed: install kvports[torch], kvports[jax] or use numpy")
    check_gpu_reachable(device, problems)
    return usable, reasons


def teacher_forced_logits(
    port: Port, model: Any, prompts: np.ndarray, reference_tokens: np.ndarray, mode: str
) -> np.ndarray:
    """The step logits [B, N, V] of each row fed the reference's own tokens: naive as one chunk,
    cached as the prompt then one token per chunk, as generate does. Row by row, so a left-padded
    prompt needs no padding; zeros where the reference row had already stopped."""
    B, P = prompts.shape
    generated = np.asarray(reference_tokens)[:, P:]  # [B, N]
    result: np.ndarray | None = None
    for row in range(B):
        prompt = prompts[row][prompts[row] != PAD]  # [P_b]
        made = generated[row][generated[row] != PAD]  # [n_b]: PAD only after a stop
        history = np.concatenate([prompt, made[:-1]])[None]  # [1, P_b + n_b - 1]: the last token is never fed
        chunks = [history.shape[1]] if mode == "naive" else [len(prompt)] + [1] * (len(made) - 1)
        logits = port.forward_chunks(model, history, chunks)[0, len(prompt) - 1 :]  # [n_b, V]
        if result is None:
            result = np.zeros((B, generated.shape[1], logits.shape[-1]), dtype=logits.dtype)
        result[row, : len(made)] = logits
    assert result is not None  # check_prompts refuses an empty batch
    return result


def run(args: argparse.Namespace) -> int:
    speculative = args.draft is not None  # a speculative row per framework, beside naive and cached
    modes = ("naive", "cached") + (("speculative",) if speculative else ())
    check_count("--repeats", args.repeats)  # as the bench bounds its own
    given = read_inputs(args, ports.REFERENCE, "naive", modes)
    warn_unused(args, speculative)
    config, tensors, prompts, generation = given.config, given.tensors, given.prompts, given.inputs.generation
    P = prompts.shape[1]
    usable, reasons = usable_ports(args.device)
    for name in ports.PORTS:  # a port without the run's precision gets rows that say so
        missing = missing_precision(name, args.dtype, args.quant)
        if usable[name] is not None and missing is not None:
            usable[name], reasons[name] = None, f"no {missing}"
    reference = next(name for name in [ports.REFERENCE, *ports.PORTS] if usable[name] is not None)
    order = [reference] + [name for name in ports.PORTS if name != reference]
    rows: list[dict[str, Any]] = []
    results: dict[tuple[str, str], tuple[np.ndarray, np.ndarray | None]] = {}
    forced: dict[tuple[str, str], np.ndarray] = {}
    with make_progress(args.json) as progress:
        task = progress.add_task("compare", total=len(modes) * len(order))
        for name in order:
            port = usable[name]
            model = None
            for mode in modes:
                progress.update(task, description=f"{name} {mode}")
                row: dict[str, Any] = {"framework": name, "mode": mode, "device": placement(name, args.device)}
                if port is None:
                    rows.append({**row, "available": False, "reason": reasons[name]})
                    progress.advance(task)
                    continue
                if model is None:
                    model = LoadedModel(
                        port,
                        port.load_model(config, tensors, args.dtype, placement(name, args.device), quant=args.quant),
                        config,
                        name,
                        args.dtype,
                        placement(name, args.device),
                    )
                    if given.draft is not None:
                        model.add_draft(args.draft, *given.draft)
                row["available"] = True
                inputs = dataclasses.replace(given.inputs, framework=name, mode=mode)
                row.update(measure(model, prompts, inputs, args.repeats, results))
                if mode != "speculative" and args.teacher_forced:
                    reference_tokens = results[(reference, "naive")][0]
                    forced[(name, mode)] = teacher_forced_logits(port, model.model, prompts, reference_tokens, mode)
                rows.append(row)
                progress.advance(task)
    ref_tokens, ref_logits = results[(reference, "naive")]
    assert ref_logits is not None  # asked for with return_logits=True
    for row in rows:
        if not row["available"]:
            continue
        tokens, logits = results[(row["framework"], row["mode"])]
        if row["mode"] == "speculative" and not generation.greedy:
            # Speculative sampling draws by its own rule: the reference is the reference's speculative run.
            agreement = compare_tokens(results[(reference, "speculative")][0], tokens, P, None)
        else:
            agreement = compare_tokens(ref_tokens, tokens, P, ref_logits, generation)
        row.update(agreement.as_dict())
        difference = None
        if args.teacher_forced and row["mode"] != "speculative":
            every_step = np.asarray(ref_tokens)[:, P:] != PAD  # [B, N]
            difference = logit_difference(
                forced[(reference, "naive")], forced[(row["framework"], row["mode"])], every_step, True
            )
        elif logits is not None:
            difference = logit_difference(ref_logits, logits, comparable_steps(ref_tokens, tokens, P), False)
        row["logits"] = None if difference is None else difference.as_dict()
        naive = next(r for r in rows if r["framework"] == row["framework"] and r["mode"] == "naive")
        row["cached_speedup"] = naive["seconds"] / row["seconds"] if row["mode"] != "naive" else None
    if args.dtype == "bfloat16" or args.quant != "none":
        compare_float32(rows, results, usable[reference], config, tensors, prompts, given.inputs, args.device)
    ok = all(row["explained"] for row in rows if row["available"])
    if args.json:
        print(
            json.dumps(
                {
                    "reference": f"{reference} naive",
                    "family": config.family,
                    "dtype": args.dtype,
                    "quant": args.quant,
                    "device": args.device,
                    "generation": dataclasses.asdict(generation),
                    "prompt": row_tokens(prompts),
                    "new_tokens": args.new_tokens,
                    "teacher_forced": args.teacher_forced,
                    "repeats": args.repeats,
                    "near_tie": NEAR_TIE,
                    "tokens": row_tokens(ref_tokens),
                    "rows": rows,
                    "ok": ok,
                }
            )
        )
    else:
        print_table(rows, reference, config, args, prompts, generation)
    return 0 if ok else EXIT_DISAGREE


def measure(
    loaded: LoadedModel,
    prompts: np.ndarray,
    inputs: RunInputs,
    repeats: int,
    results: dict[tuple[str, str], tuple[np.ndarray, np.ndarray | None]],
) -> dict[str, Any]:
    """One row: tokens (and for naive and cached, logits) from a first call, then a warm-up and
    `repeats` timed calls without logits (for JAX another compiled program: the warm-up is its
    compile). A speculative row's first call is its warm-up."""
    draft = draft_model(loaded, inputs) if inputs.mode == "speculative" else None

    def call(return_logits: bool = False) -> tuple[np.ndarray, np.ndarray | None, dict[str, int] | None]:
        return run_port(loaded.port, loaded.model, draft, prompts, inputs, return_logits)

    figures: dict[str, Any] = {}
    if inputs.mode != "speculative":
        tokens, logits, _ = call(return_logits=True)
        results[(loaded.framework, inputs.mode)] = (tokens, logits)
    (tokens, _, counts), first_call = timed(call, loaded.port, loaded.model)
    seconds = [timed(call, loaded.port, loaded.model)[1] for _ in range(repeats)]
    median = float(np.median(seconds))
    if inputs.mode == "speculative":
        results[(loaded.framework, "speculative")] = (tokens, None)
        figures["speculative"] = counts
    return {
        "seconds": median,
        "first_call_seconds": first_call,
        # Only where the first call compiles: elsewhere first minus median is warm-up noise, not a cost.
        "compile_seconds": max(0.0, first_call - median) if loaded.framework in ports.COMPILES else None,
        "repeat_seconds": seconds,
        **figures,
    }


def compare_float32(
    rows: list[dict[str, Any]],
    results: dict[tuple[str, str], tuple[np.ndarray, np.ndarray | None]],
    reference: Port | None,
    config: ModelConfig,
    tensors: dict[str, np.ndarray],
    prompts: np.ndarray,
    inputs: RunInputs,
    device: str,
) -> None:
    """What the run's bfloat16 or quantization costs: each row against the reference's float32 path on
    the same weights (a GGUF's dequantized ones), as `vs_float32`: the largest |logit difference| up to
    the first divergence, and that step (None: every token agrees). Reported, never a failure."""
    assert reference is not None
    model = reference.load_model(config, float_tensors(tensors), "float32", placement(reference.NAME, device))
    tokens32, logits32 = reference.generate(model, prompts, inputs.generation, "naive", True)
    assert logits32 is not None
    P = prompts.shape[1]
    for row in rows:
        tokens, logits = results.get((row["framework"], row["mode"]), (None, None))
        if not row["available"] or tokens is None or logits is None:
            continue
        agreement = compare_tokens(tokens32, tokens, P, logits32, inputs.generation)
        difference = logit_difference(logits32, logits, comparable_steps(tokens32, tokens, P), False)
        row["vs_float32"] = {
            "max_abs_diff": None if difference is None else difference.max_abs_diff,
            "first_divergent_step": agreement.first_divergent_step,
            "reference_margin": agreement.reference_margin,
        }


def vs_float32_cell(row: dict[str, Any]) -> str:
    figures = row.get("vs_float32")
    if figures is None:
        return "-"
    step = figures["first_divergent_step"]
    return f"{fmt_difference(figures['max_abs_diff'] or 0)}, " + ("agree" if step is None else f"@ {step}")


def fmt_difference(value: float) -> str:
    return "0" if value == 0 else f"{value:.1e}"


def tokens_cell(row: dict[str, Any], reference: str) -> str:
    if not row["available"]:
        return (
            "not installed"
            if row["reason"] == "not installed"
            else row["reason"]
            if row["reason"][:3] == "no "
            else "no GPU"
        )
    if row["framework"] == reference and row["mode"] == "naive":
        return "reference"
    if row["agree"]:
        return "agree"
    return f"{'near-tie' if row['explained'] else 'DIFFER'} @ {row['first_divergent_step']}"


def print_table(
    rows: list[dict[str, Any]],
    reference: str,
    config: ModelConfig,
    args: argparse.Namespace,
    prompts: np.ndarray,
    generation: GenerationConfig,
) -> None:
    from rich import box
    from rich.table import Table

    where = args.device if args.device == "cpu" else "gpu (numpy on the cpu)"
    table = Table(
        title=f"kvports compare: {describe(config)}, {prompts.shape[0]} x {prompts.shape[1]}-token prompt, "
        f"{args.new_tokens} new tokens, {describe_generation(generation)}, {args.dtype}"
        + ("" if args.quant == "none" else f" {args.quant}")
        + f", {where}; "
        f"reference: {reference} naive" + (", teacher-forced" if args.teacher_forced else ""),
        box=box.SIMPLE_HEAD,
        show_edge=False,
    )
    for column, justify in (
        ("framework", "left"),
        ("mode", "left"),
        ("tokens", "left"),
        ("max\n|diff|", "right"),
        ("at\nstep", "right"),
        ("mean\n|diff|", "right"),
        ("seconds", "right"),
        ("vs\nnaive", "right"),
    ):
        table.add_column(column, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    reduced = args.dtype == "bfloat16" or args.quant != "none"
    if reduced:
        table.add_column("vs float32\nmax |diff|, tokens", justify="right", no_wrap=True)
    for row in rows:
        cells = [row["framework"], row["mode"], tokens_cell(row, reference)]
        if not row["available"]:
            table.add_row(*cells, *["-"] * (6 if reduced else 5))
            continue
        logits = row["logits"]
        cells += (
            ["-"] * 3
            if logits is None
            else [
                fmt_difference(logits["max_abs_diff"]),
                str(logits["peak_step"]) if logits["max_abs_diff"] else "-",  # no peak where nothing differs
                fmt_difference(logits["mean_abs_diff"]),
            ]
        )
        cells += [f"{row['seconds']:.4f}", "-" if row["cached_speedup"] is None else f"{row['cached_speedup']:.1f}x"]
        table.add_row(*cells, *([vs_float32_cell(row)] if reduced else []))
    console = console_for(table)
    console.print(table)
    for line in footnotes(rows, args):
        console.print(line, highlight=False, markup=False)


def footnotes(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """What the table's figures are, and each row's story where it is not plain agreement."""
    live = [row for row in rows if row["available"]]
    notes = []
    for row in live:
        if not row["agree"] and row["reference_margin"] is not None:
            notes.append(
                f"{row['framework']} {row['mode']}: tokens part at step {row['first_divergent_step']} "
                f"(row {row['divergent_row']}), where the reference's margin was {row['reference_margin']:.1e}: "
                + ("below" if row["explained"] else "NOT below")
                + f" {NEAR_TIE:.0e}, "
                + ("a float near-tie" if row["explained"] else "a real disagreement")
            )
        elif not row["agree"]:
            notes.append(f"{row['framework']} {row['mode']}: tokens part at step {row['first_divergent_step']}")
    if args.teacher_forced:
        notes.append(
            "logits: |logit - reference logit| with every port fed the reference's tokens, at every step "
            "(max, the step where it peaks, mean over every logit)"
        )
    else:
        notes.append(
            "logits: |logit - reference logit| up to each row's first divergence (max, the step where it "
            "peaks, mean over every logit); --teacher-forced compares every step"
        )
    compiled = [row for row in live if row.get("compile_seconds") is not None]
    timing = (
        f"seconds: median of {args.repeats} runs of the whole generation after a warm-up (per-step latency and "
        "time to first token: kvports bench)"
    )
    if compiled:
        timing += "; compile time apart, the first call minus that median: " + ", ".join(
            f"{row['framework']} {row['mode']} {row['compile_seconds']:.2f} s" for row in compiled
        )
    notes.append(timing)
    for row in rows:
        if not row["available"] and row["reason"] != "not installed" and row["mode"] == "naive":
            notes.append(f"{row['framework']}: {row['reason']}")
    return notes
