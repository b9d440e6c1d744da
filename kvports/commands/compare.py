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

from kvports import generating, loading, registry
from kvports.agreement import NEAR_TIE, comparable_steps, compare_tokens, logit_difference
from kvports.commands.generate_command import describe_generation
from kvports.commands.inputs import (
    add_generation_arguments,
    add_input_arguments,
    add_text_arguments,
    read_inputs,
    warn_unused,
)
from kvports.devices import add_device_argument, placement
from kvports.families import describe
from kvports.flags import add_speculative_arguments, positive_int
from kvports.generating import RunInputs
from kvports.loading import LoadedModel
from kvports.progress import make_progress
from kvports.shared.checks import check_count
from kvports.shared.config import ModelConfig
from kvports.shared.contract import Port
from kvports.shared.errors import UserError, echo
from kvports.shared.generation import PAD, GenerationConfig, row_tokens
from kvports.shared.quantization import float_tensors
from kvports.terminal import console_for
from kvports.threads import describe_threads, use_threads
from kvports.validation import MODES

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
    parser.add_argument(
        "--frameworks",
        default=",".join(registry.PORTS),
        help=f"comma-separated subset of {','.join(registry.PORTS)} (default all)",
    )
    parser.add_argument(
        "--modes",
        default=None,
        help="comma-separated subset of naive,cached,speculative (default naive,cached, and speculative with "
        "--draft); the reference is the first framework's first mode of naive and cached",
    )
    add_generation_arguments(parser)
    add_speculative_arguments(parser)


def chosen_rows(args: argparse.Namespace) -> tuple[list[str], tuple[str, ...]]:
    """--frameworks and --modes as lists, in the table's order; --modes' default has speculative with --draft."""
    from kvports.bench.options import parse_choices

    frameworks = parse_choices(args.frameworks, registry.PORTS, "frameworks")
    default = "naive,cached" + (",speculative" if args.draft is not None else "")
    modes = tuple(parse_choices(args.modes if args.modes is not None else default, MODES, "modes"))
    if "speculative" in modes and args.draft is None:
        raise UserError("--modes speculative needs --draft FILE (a smaller model) or --draft ngram")
    if not set(modes) & {"naive", "cached"}:
        raise UserError(f"--modes {echo(args.modes)} needs naive or cached too: the reference is a run with logits")
    return frameworks, modes


def usable_ports(
    frameworks: list[str], unable: dict[str, str], device: str, tensor_parallel: int, given: str
) -> tuple[dict[str, Port], dict[str, str]]:
    """Each framework asked for that can run here, with its port; the others with the reason their
    rows give: a rule (`unable`, from `check_rules`: no bfloat16), not installed, no GPU. `given`: --frameworks."""
    runnable = [name for name in frameworks if name not in unable]
    ports, reasons = loading.usable_ports(runnable, device, tensor_parallel)
    reasons = {**unable, **reasons}
    if not ports:
        if (
            device == "cpu"
            and set(frameworks) == set(registry.PORTS)
            and set(reasons.values()) == {loading.NOT_INSTALLED}
        ):
            raise UserError("no framework is installed: install kvports[torch], kvports[jax] or use numpy")
        unusable = "; ".join(f"{name}: {reasons[name]}" for name in frameworks)
        raise UserError(f"--frameworks {echo(given)} names no framework that can run here ({unusable})")
    return ports, reasons


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
    frameworks, modes = chosen_rows(args)
    speculative = "speculative" in modes  # a speculative row per framework, beside naive and cached
    check_count("--repeats", args.repeats)  # as the bench bounds its own
    given = read_inputs(args, registry.REFERENCE, "naive", modes, frameworks)
    warn_unused(args, speculative)
    config, tensors, prompts, generation = given.config, given.tensors, given.prompts, given.inputs.generation
    P = prompts.shape[1]
    use_threads(given.inputs.threads)
    usable, reasons = usable_ports(frameworks, given.unable, args.device, args.tensor_parallel, args.frameworks)
    reference = next(name for name in [registry.REFERENCE, *frameworks] if name in usable)
    reference_mode = next(mode for mode in modes if mode != "speculative")
    order = [reference] + [name for name in frameworks if name != reference]
    rows: list[dict[str, Any]] = []
    results: dict[tuple[str, str], tuple[np.ndarray, np.ndarray | None]] = {}
    forced: dict[tuple[str, str], np.ndarray] = {}
    with make_progress(args.json) as progress:
        task = progress.add_task("compare", total=len(modes) * len(order))
        for name in order:
            model = None
            for mode in modes:
                progress.update(task, description=f"{name} {mode}")
                row: dict[str, Any] = {"framework": name, "mode": mode, "device": placement(name, args.device)}
                if name not in usable:
                    rows.append({**row, "available": False, "reason": reasons[name]})
                    progress.advance(task)
                    continue
                if model is None:
                    model = loading.load_model(
                        name,
                        config,
                        tensors,
                        args.dtype,
                        placement(name, args.device),
                        quant=args.quant,
                        tensor_parallel=args.tensor_parallel,
                        port=usable[name],
                    )
                    if given.draft is not None:
                        model.add_draft(args.draft, *given.draft)
                row["available"] = True
                inputs = dataclasses.replace(given.inputs, framework=name, mode=mode)
                row.update(measure(model, prompts, inputs, args.repeats, results))
                if mode != "speculative" and args.teacher_forced:
                    reference_tokens = results[(reference, reference_mode)][0]
                    forced[(name, mode)] = teacher_forced_logits(
                        model.port, model.model, prompts, reference_tokens, mode
                    )
                rows.append(row)
                progress.advance(task)
    ref_tokens, ref_logits = results[(reference, reference_mode)]
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
                forced[(reference, reference_mode)], forced[(row["framework"], row["mode"])], every_step, True
            )
        elif logits is not None:
            difference = logit_difference(ref_logits, logits, comparable_steps(ref_tokens, tokens, P), False)
        row["logits"] = None if difference is None else difference.as_dict()
        row.update(speedups(rows, row))
    if args.dtype == "bfloat16" or args.quant != "none":
        compare_float32(rows, results, usable[reference], config, tensors, prompts, given.inputs, args.device)
    ok = all(row["explained"] for row in rows if row["available"])
    if args.json:
        print(
            json.dumps(
                {
                    "reference": f"{reference} {reference_mode}",
                    "frameworks": frameworks,
                    "modes": list(modes),
                    "threads": given.inputs.threads,
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
        print_table(rows, f"{reference} {reference_mode}", config, args, prompts, generation)
    return 0 if ok else EXIT_DISAGREE


def speedups(rows: list[dict[str, Any]], row: dict[str, Any]) -> dict[str, float | None]:
    """A row's time against the same framework's naive row (cached_speedup; not for naive) and a
    speculative row's against its cached row (speculative_speedup): None where that row was not run."""

    def seconds(mode: str) -> float | None:
        same = [r for r in rows if r["framework"] == row["framework"] and r["mode"] == mode and r["available"]]
        return same[0]["seconds"] if same else None

    naive, cached = seconds("naive"), seconds("cached")
    return {
        "cached_speedup": None if naive is None or row["mode"] == "naive" else naive / row["seconds"],
        "speculative_speedup": None if cached is None or row["mode"] != "speculative" else cached / row["seconds"],
    }


def describe_prompts(prompts: np.ndarray) -> str:
    """'1 x 5-token prompt', '2 x 5-token prompts', or for ragged rows '2 prompts of 2-4 tokens'."""
    lengths = [len(row) for row in row_tokens(prompts)]
    if min(lengths) == max(lengths):
        return f"{len(lengths)} x {lengths[0]}-token prompt" + "s" * (len(lengths) > 1)
    return f"{len(lengths)} prompts of {min(lengths)}-{max(lengths)} tokens"


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
    figures: dict[str, Any] = {}
    if inputs.mode != "speculative":
        first = generating.generate(loaded, prompts, inputs, return_logits=True)
        assert first.padded is not None
        results[(loaded.framework, inputs.mode)] = (first.padded, first.logits)
    warm = generating.generate(loaded, prompts, inputs)
    seconds = [generating.generate(loaded, prompts, inputs).seconds for _ in range(repeats)]
    median = float(np.median(seconds))
    if inputs.mode == "speculative":
        assert warm.padded is not None and warm.speculative is not None
        results[(loaded.framework, "speculative")] = (warm.padded, None)
        figures["speculative"] = warm.speculative  # with its rates
    return {
        "seconds": median,
        "first_call_seconds": warm.seconds,
        # Only where the first call compiles: elsewhere first minus median is warm-up noise, not a cost.
        "compile_seconds": max(0.0, warm.seconds - median) if loaded.framework in registry.COMPILES else None,
        "repeat_seconds": seconds,
        **figures,
    }


def compare_float32(
    rows: list[dict[str, Any]],
    results: dict[tuple[str, str], tuple[np.ndarray, np.ndarray | None]],
    reference: Port,
    config: ModelConfig,
    tensors: dict[str, np.ndarray],
    prompts: np.ndarray,
    inputs: RunInputs,
    device: str,
) -> None:
    """What the run's bfloat16 or quantization costs: each row against the reference's float32 path on
    the same weights (a GGUF's dequantized ones), as `vs_float32`: the largest |logit difference| up to
    the first divergence, and that step (None: every token agrees). Reported, never a failure."""
    name = reference.NAME
    model = loading.load_model(name, config, float_tensors(tensors), "float32", placement(name, device), port=reference)
    float32 = dataclasses.replace(
        inputs, framework=name, mode="naive", dtype="float32", quant="none", tensor_parallel=1
    )
    result = generating.generate(model, prompts, float32, return_logits=True)
    tokens32, logits32 = result.padded, result.logits
    assert tokens32 is not None and logits32 is not None
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
            if row["device"] == "gpu"
            else "unavailable"  # a framework older than the port needs: the footnote says which
        )
    if f"{row['framework']} {row['mode']}" == reference:
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
    speculative = any(row["mode"] == "speculative" and row["available"] for row in rows)
    table = Table(
        title=f"kvports compare: {describe(config)}, {describe_prompts(prompts)}, "
        f"{args.new_tokens} new tokens, {describe_generation(generation)}, {args.dtype}"
        + ("" if args.quant == "none" else f" {args.quant}")
        + f", {where}, {describe_threads(args.threads)}; reference: {reference}"
        + (", teacher-forced" if args.teacher_forced else ""),
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
        *[("vs\ncached", "right"), ("draft\nkept", "right")] * speculative,
    ):
        table.add_column(column, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    reduced = args.dtype == "bfloat16" or args.quant != "none"
    if reduced:
        table.add_column("vs float32\nmax |diff|, tokens", justify="right", no_wrap=True)
    for row in rows:
        cells = [row["framework"], row["mode"], tokens_cell(row, reference)]
        if not row["available"]:
            table.add_row(*cells, *["-"] * (5 + 2 * speculative + reduced))
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
        if speculative:
            counts = row.get("speculative")
            cells += [
                "-" if row["speculative_speedup"] is None else f"{row['speculative_speedup']:.2f}x",
                "-" if counts is None else f"{counts['acceptance_rate']:.0%}",
            ]
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
        f"seconds: median of {args.repeats} run{'s' * (args.repeats != 1)} of the whole generation after a warm-up "
        "(per-step latency and "
        "time to first token: kvports bench)"
    )
    if compiled:
        timing += "; compile time apart, the first call minus that median: " + ", ".join(
            f"{row['framework']} {row['mode']} {row['compile_seconds']:.2f} s" for row in compiled
        )
    notes.append(timing)
    if any(row["mode"] == "speculative" for row in live):
        notes.append(
            "speculative: its tokens against the reference's (greedy: they must be equal); vs cached: the same "
            "framework's cached seconds over its own; draft kept: the draft's proposals the target accepted"
        )
    for row in rows:
        if not row["available"] and row["reason"] != "not installed" and row["mode"] == "naive":
            notes.append(f"{row['framework']}: {row['reason']}")
    return notes
