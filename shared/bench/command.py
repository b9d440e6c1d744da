"""`kvports bench` from start to end: check the flags, load the model, run the rows, then the
targets, the plots and one of table, JSON or CSV."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

from kvports.shared.bench.arguments import check_bench_run, check_counts, parse_choices, parse_sweep
from kvports.shared.bench.measure import load_average, threads_info
from kvports.shared.bench.output import print_result
from kvports.shared.bench.plots import write_plots
from kvports.shared.bench.presets import bench_prompts, load_bench_model
from kvports.shared.bench.rows import run_rows
from kvports.shared.bench.runners import COMPILED_RUNNER, FRAMEWORKS, MODES, RUNNERS
from kvports.shared.bench.targets import targets
from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError
from kvports.shared.progress import make_progress


def run(args: argparse.Namespace) -> int:
    check_counts(args)
    frameworks = parse_choices(args.frameworks, FRAMEWORKS, "frameworks")
    modes = parse_choices(args.modes, MODES, "modes")
    if args.plot is not None and not args.plot.parent.is_dir():
        raise UserError(f"folder {str(args.plot.parent)!r} does not exist (needed for --plot {str(args.plot)!r})")
    sweep: list[int] = []

    def check(config: ModelConfig) -> None:  # before any tensor is read or drawn
        sweep.extend(parse_sweep(args.sweep, args.new_tokens, args.prompt_len, config, args.plot is not None))
        check_bench_run(config, args, modes, max([args.new_tokens, *sweep]))

    preset, config, tensors = load_bench_model(args, check)
    prompts = bench_prompts(config, args.batch, args.prompt_len, args.new_tokens)  # [B, P]
    roofline = args.roofline or preset == "gpt2-small"
    runners = [runner for runner in RUNNERS if runner.framework in frameworks]
    if args.compile:
        runners.append(COMPILED_RUNNER)
    settings: dict[str, Any] = {
        "preset": preset,
        "config": json.loads(config.to_json()),
        "parameters": int(sum(a.size for a in tensors.values())),
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "dtype": args.dtype,
        "device": args.device,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "sweep": sweep,
        "prompt": prompts[0].tolist(),
    }
    start, load_before = time.perf_counter(), load_average()
    with make_progress(args.json or args.csv) as progress:
        rows, machine_info = run_rows(runners, modes, config, tensors, prompts, args, sweep, roofline, progress)
    settings["versions"] = machine_info.pop("versions")
    settings["threads"] = threads_info()
    machine = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        **machine_info,
        "bench_seconds": time.perf_counter() - start,
        "load_average": [load_before, load_average()],
    }
    result: dict[str, Any] = {"settings": settings, "machine": machine, "rows": rows}
    result["targets"] = targets(rows, settings)
    if args.plot is not None:
        args.plot.mkdir(exist_ok=True)
        result["plots"] = [str(path) for path in write_plots(result, args.plot)]
    print_result(result, "json" if args.json else "csv" if args.csv else "table")
    return 0
