"""`kvports bench` from start to end: check the flags and the outputs, load the model, run the
rows (writing the plots as each framework's rows finish), then the targets and one of table,
JSON or CSV."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

from kvports import registry
from kvports.bench.formats import Formats, format_name, parse_formats
from kvports.bench.measure import load_average, threads_info
from kvports.bench.options import parse_choices, parse_sweep, parse_threads, resolve_counts, resolve_pp
from kvports.bench.output import print_result
from kvports.bench.plots import write_plots
from kvports.bench.presets import bench_prompts, chat_turn_ids, load_bench_model
from kvports.bench.rows import run_rows
from kvports.bench.runners import COMPILED_RUNNER, FRAMEWORKS, MODES, PEER_RUNNERS, RUNNERS, Runner, group_of
from kvports.bench.targets import add_peer_ratios, targets
from kvports.devices import prepare_tensor_parallel
from kvports.progress import make_progress
from kvports.run import NOT_INSTALLED, Draft, RunInputs, read_draft, usable_ports
from kvports.shared.checks import COMMAND_LINE
from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError
from kvports.shared.generation import GenerationConfig
from kvports.shared.quantization import float_tensors
from kvports.threads import use_threads
from kvports.validation import (
    Setup,
    check_bench_counts,
    check_bench_outputs,
    check_bench_run,
    check_draft,
    check_needed,
    check_ngram,
    check_rules,
)


def bench_setups(runners: list[Runner], modes: list[str], formats: Formats, args: argparse.Namespace) -> list[Setup]:
    """What the bench asks of `check_rules` besides its weight formats (`Formats.check`: a list skips
    the formats a port lacks): its runners in its modes on --device, at N = 1 and at each split asked
    for. A split runs unquantized where --quant lists none, and is refused as generate refuses quant
    across devices otherwise; a port that cannot split gets no split rows, unless no runner can. The
    baselines count for the device only."""
    frameworks = tuple(dict.fromkeys(runner.framework for runner in runners))
    split_quant = "none" if "none" in formats.quants else formats.quants[0]
    return [
        Setup(frameworks, tuple(modes), device=args.device, tensor_parallel=n, quant=split_quant if n > 1 else "none")
        for n in dict.fromkeys((1, *args.tensor_parallel))
    ]


def port_problems(runners: list[Runner], device: str) -> dict[str, str]:
    """Each runner (by label) whose port cannot reach the device it was asked to run on -> why; one
    `error:` line instead when none of them can (`--device gpu` on a machine without a GPU). A split
    beyond a port's devices is its rows' own reason (`run_rows`): --tensor-parallel takes a list."""
    if device == "cpu":
        return {}  # every framework runs on the CPU: nothing to import early
    libraries = list(dict.fromkeys(runner.library for runner in runners))
    # A framework that is not installed says so in its own rows, later; here it only counts as unusable.
    _, reasons = usable_ports(libraries, device)
    return {
        runner.label: reasons[runner.library]
        for runner in runners
        if reasons.get(runner.library, NOT_INSTALLED) != NOT_INSTALLED
    }


def run_batching(args: argparse.Namespace) -> int:
    """`kvports bench --requests N`: `kvports batch --bench`'s two workloads, N requests each."""
    from kvports.bench.options import add_arguments, batching_inputs
    from kvports.bench.throughput import run_bench

    bench_parser = argparse.ArgumentParser()
    add_arguments(bench_parser)
    defaults = vars(bench_parser.parse_args([]))  # every bench flag at its default
    return run_bench(batching_inputs(args, defaults, registry.PORTS))


def run_serving(args: argparse.Namespace) -> int:
    """`kvports bench --serve`: kvports serve per port (and llama.cpp's server) under concurrent clients."""
    from kvports.bench.options import add_arguments
    from kvports.bench.serving import SERVING_FLAGS, run_serving, serving_inputs

    bench_parser = argparse.ArgumentParser()
    add_arguments(bench_parser)
    defaults = vars(bench_parser.parse_args([]))  # every bench flag at its default
    changed = [name for name, value in defaults.items() if name not in SERVING_FLAGS and getattr(args, name) != value]
    return run_serving(serving_inputs(args, changed))


def run(args: argparse.Namespace) -> int:
    if args.serve:
        return run_serving(args)
    if args.requests is not None:
        return run_batching(args)
    resolve_counts(args)
    check_bench_counts(args.batch, args.prompt_len, args.new_tokens, args.repeats, args.warmup)
    counts = parse_threads(args.threads)
    if len(counts) > 1 or args.rounds > 1:
        return run_interleaved(args, counts)
    args.threads = counts[0]
    frameworks = parse_choices(args.frameworks, FRAMEWORKS, "frameworks")
    modes = parse_choices(args.modes, MODES, "modes")
    formats = parse_formats(args.dtype, args.quant)
    dtype, quant = formats.first  # the baselines', the peers' and the reference's
    check_bench_outputs(args.plot, args.csv, args.json)
    if "speculative" in modes and args.draft is None:
        raise UserError("--modes speculative needs --draft FILE (a smaller model) or --draft ngram")
    runners = [runner for runner in RUNNERS if runner.framework in frameworks]
    if args.compile:
        runners.append(COMPILED_RUNNER)
    if args.peers:
        runners.extend(PEER_RUNNERS)
    if args.group is not None:  # one group's rows in a process of its own (bench.rounds' child)
        runners = [runner for runner in runners if group_of(runner) == args.group]
    timed = [runner for runner in runners if set(runner.modes) & set(modes) and not runner.peer]  # peers: CPU
    # A port without a single --dtype or --quant value's precision refuses it, as generate does.
    port_names = [framework for framework in frameworks if framework in registry.PORTS]
    formats.check(port_names)
    setups = bench_setups(timed, modes, formats, args)
    sweep: list[int] = []
    unusable: dict[str, str] = {}  # runner label -> why its rows cannot run

    def check(config: ModelConfig) -> None:  # before any tensor is read or drawn
        sweep.extend(parse_sweep(args.sweep, args.new_tokens, args.prompt_len, config, args.plot is not None))
        longest = max([args.new_tokens, *sweep])
        resolve_pp(args, config)
        for listed in formats.dtypes:  # each format's model and run, one at a time
            check_bench_run(config, modes, longest, listed, args.batch, args.prompt_len, args.new_tokens)
            if args.pp:
                if args.pp + 1 > config.max_seq_len:
                    raise UserError(f"--pp {args.pp} + 1 new token exceeds max_seq_len {config.max_seq_len}")
                check_bench_run(config, modes, 1, listed, args.batch, args.pp, 1)
        for setup in setups:
            unable = check_rules(setup, COMMAND_LINE, [("the model", config)])
            if setup.tensor_parallel == 1:  # a split's own refusals only leave a port without split rows
                unusable.update(
                    {runner.label: unable[runner.framework] for runner in timed if runner.framework in unable}
                )
        prepare_tensor_parallel(max(args.tensor_parallel), args.device, frameworks)  # before a port starts JAX
        unusable.update(port_problems(timed, args.device))

    port_formats = formats.offered(port_names)  # the formats some port will run, in the rows' order
    chat = None if args.chat is None else chat_turn_ids(args.weights, args.chat)  # its length is the prompt's
    if chat is not None:
        args.prompt_len = len(chat)
    # A GGUF file's 4-bit blocks too when a q4 row will run (a file without any refused, as --quant q4 alone).
    blocks = "q4" if ("q4" in {pair[1] for pair in port_formats}) else "none"
    preset, config, tensors = load_bench_model(
        args.preset, args.weights, formats.read_dtype, check, blocks, formats.dtypes
    )
    prompts = bench_prompts(config, args.batch, args.prompt_len, args.new_tokens, chat)  # [B, P]
    draft_weights = None
    if "speculative" in modes:
        draft = Draft(args.draft, args.draft_tokens, args.ngram)
        generation = GenerationConfig(args.new_tokens)
        inputs = RunInputs(
            frameworks[0], "speculative", generation, args.weights, formats.read_dtype, args.device, draft
        )
        check_draft("speculative", args.draft, args.draft_tokens, args.ngram, COMMAND_LINE)
        check_ngram(args.ngram, args.prompt_len, args.new_tokens)
        check_needed(args.prompt_len, args.new_tokens, args.draft_tokens, [("the model", config)])
        draft_weights = read_draft(inputs, config, prompts, setups)  # read as the model is; each row casts it
    pp_prompts = bench_prompts(config, args.batch, args.pp, 1) if args.pp else None  # [B, P']
    roofline = args.roofline or preset == "gpt2-small" or args.peers  # the peers' rows are held to it too
    settings: dict[str, Any] = {
        "preset": preset,
        "config": json.loads(config.to_json()),
        "parameters": int(sum(a.size for a in float_tensors(tensors).values())),
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "pp": args.pp or None,
        "dtype": dtype,
        "quant": quant,
        "formats": [format_name(*pair) for pair in port_formats],
        "device": args.device,
        "tensor_parallel": list(args.tensor_parallel),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "sweep": sweep,
        "prompt": prompts[0].tolist(),
        "draft": None if draft_weights is None and args.draft != "ngram" else str(args.draft),
        "draft_tokens": args.draft_tokens if "speculative" in modes else None,
        "peers": args.peers,
        "chat": args.chat,
    }
    plots: list[str] = []

    def plot_so_far(rows: list[dict[str, Any]]) -> None:
        # Each framework's figures as soon as its rows exist: a long run shows (and keeps) what it has.
        if args.plot is not None:
            args.plot.mkdir(exist_ok=True)
            plots[:] = [str(path) for path in write_plots({"settings": settings, "rows": rows}, args.plot)]

    use_threads(args.threads)
    start, load_before = time.perf_counter(), load_average()
    with make_progress(args.json or str(args.csv) == "-") as progress:
        rows, machine_info = run_rows(
            runners,
            modes,
            config,
            tensors,
            prompts,
            args,
            formats,
            sweep,
            roofline,
            progress,
            draft_weights,
            unusable,
            plot_so_far,
            pp_prompts,
        )
    for row in rows:
        row["threads"] = args.threads
    settings["versions"] = machine_info.pop("versions")
    settings["threads"] = {"--threads": "default" if args.threads is None else args.threads, **threads_info(args.peers)}
    machine = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        **machine_info,
        "bench_seconds": time.perf_counter() - start,
        "load_average": [load_before, load_average()],
    }
    finish({"settings": settings, "machine": machine, "rows": rows}, args)
    return 0


def finish(result: dict[str, Any], args: argparse.Namespace) -> None:
    """The peers' ratios and the targets, the plots once more (now with the rooflines), then the output."""
    add_peer_ratios(result["rows"])
    result["targets"] = targets(result["rows"], result["settings"])
    if args.plot is not None:
        args.plot.mkdir(exist_ok=True)
        result["plots"] = [str(path) for path in write_plots(result, args.plot)]
    print_result(result, args)


def run_interleaved(args: argparse.Namespace, counts: list[int | None]) -> int:
    """--threads N1,N2,... or --rounds R: a process per round and count (kvports.bench.rounds), merged."""
    from kvports.bench.rounds import run_interleaved as run_rounds

    check_bench_outputs(args.plot, args.csv, args.json)
    finish(run_rounds(args, counts), args)
    return 0
