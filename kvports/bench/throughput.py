"""Continuous batching against the same requests run one after another, per port.

Two workloads (greedy, random token ids, seeded):
- `mixed`: prompts of 16-256 tokens, 16-128 new tokens each. Batched: every request queued at
  once and run by the engine; sequential: each one through the same port's cached path
  (`run.generate`, mode cached, one prompt), one after another. Requests/s, tokens/s,
  the speed-up, and how many requests got the same tokens both ways.
- `prefix`: every request is one 256-token prefix plus its own 16-64 tokens, 16-64 new tokens;
  batched with and without prefix caching: prefill tokens computed and time to first token.

JAX compiles a program per shape, so for JAX both sides run once untimed first and the
compile time is reported apart; the other ports are timed on their first run. Nothing here
asserts a timing: targets are measured and reported.

`run_bench(BatchingBench(...))` is what `kvports batch --bench` and `kvports bench --requests N` call.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvports.batching.engine import BatchSettings, Engine, run_bytes
from kvports.batching.request import Request
from kvports.bench.measure import load_average
from kvports.bench.presets import load_bench_model
from kvports.devices import placement
from kvports.limits import check_bytes
from kvports.progress import make_progress
from kvports.registry import COMPILES, not_installed
from kvports.run import LoadedModel, RunInputs, generate, load_model, usable_ports
from kvports.shared.config import ModelConfig
from kvports.shared.contract import Port
from kvports.shared.errors import UserError
from kvports.shared.generation import GenerationConfig
from kvports.threads import check_threads, describe_threads, use_threads
from kvports.validation import Setup, check_rules

WORKLOADS = ("mixed", "prefix")
MIXED_PROMPT, MIXED_NEW = (16, 256), (16, 128)
PREFIX_LEN, PREFIX_SUFFIX, PREFIX_NEW = 256, (16, 64), (16, 64)
TARGET_SPEEDUP, TARGET_PREFILL_RATIO = 5.0, 5.0  # the development targets, reported against, never asserted

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "XLA_FLAGS")

Tick = Callable[[str], None]


def mixed_requests(config: ModelConfig, count: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    requests = []
    for index in range(count):
        prompt = rng.integers(0, config.vocab_size, size=int(rng.integers(MIXED_PROMPT[0], MIXED_PROMPT[1] + 1)))
        new_tokens = int(rng.integers(MIXED_NEW[0], MIXED_NEW[1] + 1))
        requests.append(Request(f"mixed-{index}", tuple(prompt.tolist()), GenerationConfig(new_tokens)))
    return requests


def prefix_requests(config: ModelConfig, count: int, seed: int = 1) -> list[Request]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, config.vocab_size, size=PREFIX_LEN).tolist()
    requests = []
    for index in range(count):
        suffix = rng.integers(0, config.vocab_size, size=int(rng.integers(PREFIX_SUFFIX[0], PREFIX_SUFFIX[1] + 1)))
        new_tokens = int(rng.integers(PREFIX_NEW[0], PREFIX_NEW[1] + 1))
        requests.append(Request(f"prefix-{index}", tuple(prefix + suffix.tolist()), GenerationConfig(new_tokens)))
    return requests


def longest(requests: list[Request]) -> int:
    return max(request.max_length for request in requests)


# ---------------------------------------------------------------- the two ways to run them


def run_batched(
    port: Any, model: Any, config: ModelConfig, requests: list[Request], settings: BatchSettings
) -> dict[str, Any]:
    engine = Engine(port, model, config, settings)
    start = time.perf_counter()
    for request in requests:
        engine.add(request)
    finished = engine.run()
    port.synchronize(model)
    seconds = time.perf_counter() - start
    stats = engine.stats
    return {
        "seconds": seconds,
        "tokens": {sequence.request.id: sequence.generated for sequence in finished},
        "ttft_s": [sequence.first_token_time - sequence.arrival for sequence in finished],  # type: ignore[operator]
        "steps": dict(stats.steps),
        "step_seconds": dict(stats.seconds),
        "prefill_tokens": stats.prefill_tokens,
        "padded_prefill_tokens": stats.padded_prefill_tokens,
        "cached_tokens": stats.cached_tokens,
        "prefix_hit_rate": stats.prefix_hit_rate,
        "preemptions": stats.preemptions,
        "peak_blocks": engine.blocks.peak_used,
        "num_blocks": engine.blocks.num_blocks,
    }


def run_sequential(loaded: LoadedModel, requests: list[Request]) -> dict[str, Any]:
    """Each request alone, one after another, through the run layer's cached generate."""
    tokens = {}
    start = time.perf_counter()
    for request in requests:
        inputs = RunInputs(loaded.framework, "cached", request.generation)
        tokens[request.id] = generate(loaded, np.asarray([request.prompt]), inputs).generated[0]
    return {"seconds": time.perf_counter() - start, "tokens": tokens}


def with_compile_time(run: Callable[[], dict[str, Any]], warm_up: bool) -> dict[str, Any]:
    """One timed run; for a compiling port, after an untimed one (its extra time: compile_s)."""
    first = run() if warm_up else None
    result = run()
    result["compile_s"] = None if first is None else max(0.0, first["seconds"] - result["seconds"])
    return result


# ---------------------------------------------------------------- the workloads


def throughput(requests: list[Request], seconds: float) -> dict[str, float]:
    generated = sum(request.generation.max_new_tokens for request in requests)  # greedy, no stop ids: every one
    return {"seconds": seconds, "requests_per_s": len(requests) / seconds, "tokens_per_s": generated / seconds}


def mixed_row(loaded: LoadedModel, count: int, settings: BatchSettings, tick: Tick) -> dict[str, Any]:
    port, model, config = loaded.port, loaded.model, loaded.config
    requests = mixed_requests(config, count)
    settings = BatchSettings(**{**vars(settings), "max_length": longest(requests)})
    warm_up = port.NAME in COMPILES
    # Thread pools and allocators start on a first call, whichever side would make it: a short one first.
    first = [Request("warm-up", requests[0].prompt[:16], GenerationConfig(2))]
    run_batched(port, model, config, first, settings)
    run_sequential(loaded, first)
    tick(f"{port.NAME} mixed: batched")
    batched = with_compile_time(lambda: run_batched(port, model, config, requests, settings), warm_up)
    tick(f"{port.NAME} mixed: sequential")
    sequential = with_compile_time(lambda: run_sequential(loaded, requests), warm_up)
    same = sum(batched["tokens"][request.id] == sequential["tokens"][request.id] for request in requests)
    return {
        "framework": port.NAME,
        "workload": "mixed",
        "requests": count,
        "batched": {**throughput(requests, batched["seconds"]), **without(batched, "tokens", "ttft_s")},
        "sequential": {**throughput(requests, sequential["seconds"]), "compile_s": sequential["compile_s"]},
        "speedup": sequential["seconds"] / batched["seconds"],
        "same_tokens": same,
    }


def prefix_row(loaded: LoadedModel, count: int, settings: BatchSettings, tick: Tick) -> dict[str, Any]:
    port, model, config = loaded.port, loaded.model, loaded.config
    requests = prefix_requests(config, count)
    runs = {}
    for reuse in (False, True):
        tick(f"{port.NAME} prefix: {'with' if reuse else 'without'} reuse")
        chosen = BatchSettings(**{**vars(settings), "max_length": longest(requests), "prefix_caching": reuse})

        def batched(chosen: BatchSettings = chosen) -> dict[str, Any]:
            return run_batched(port, model, config, requests, chosen)

        result = with_compile_time(batched, port.NAME in COMPILES)
        result["ttft_median_s"] = float(np.median(result["ttft_s"]))
        runs["with_reuse" if reuse else "without_reuse"] = result
    same = sum(runs["with_reuse"]["tokens"][r.id] == runs["without_reuse"]["tokens"][r.id] for r in requests)
    return {
        "framework": port.NAME,
        "workload": "prefix",
        "requests": count,
        **{
            name: {**throughput(requests, run["seconds"]), **without(run, "tokens", "ttft_s")}
            for name, run in runs.items()
        },
        "prefill_ratio": runs["without_reuse"]["prefill_tokens"] / runs["with_reuse"]["prefill_tokens"],
        "ttft_ratio": runs["without_reuse"]["ttft_median_s"] / runs["with_reuse"]["ttft_median_s"],
        "same_tokens": same,
    }


def without(result: dict[str, Any], *names: str) -> dict[str, Any]:
    return {key: value for key, value in result.items() if key not in names}


ROWS = {"mixed": mixed_row, "prefix": prefix_row}


def run_workloads(
    frameworks: list[str],
    workloads: list[str],
    config: ModelConfig,
    tensors: dict[str, np.ndarray],
    count: int,
    settings: BatchSettings,
    dtype: str = "float32",
    device: str = "cpu",
    tick: Tick = lambda text: None,
    ports: dict[str, Port] | None = None,
    reasons: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """One row per framework x workload; a framework without a usable port (`ports`: imported by
    `run.usable_ports`) gets a row saying why (`reasons`: a rule of `check_rules`, not installed, no GPU)."""
    import gc

    ports, reasons = ports or {}, reasons or {}
    rows: list[dict[str, Any]] = []
    for name in frameworks:
        if name not in ports:
            rows.extend(
                {"framework": name, "workload": workload, "available": False, "reason": reasons[name]}
                for workload in workloads
            )
            continue
        loaded = load_model(name, config, tensors, dtype, placement(name, device), port=ports[name])
        for workload in workloads:
            rows.append({"available": True, **ROWS[workload](loaded, count, settings, tick)})
        del loaded
        gc.collect()  # gpt2-small: free one framework's weights before the next loads them
    return rows


# ---------------------------------------------------------------- kvports batch --bench


@dataclass(frozen=True)
class BatchingBench:
    """The batching bench's inputs, typed (from `kvports batch --bench` or `kvports bench --requests`)."""

    frameworks: tuple[str, ...]
    workloads: tuple[str, ...]
    count: int  # requests per workload
    settings: BatchSettings  # the engine's; max_length is set from the requests
    preset: str = "gpt2-small"
    weights: Path | None = None  # times this file instead of the preset
    dtype: str = "float32"
    device: str = "cpu"
    json: bool = False
    threads: int | None = None  # every framework's thread count (None: each one's default)


# The batching bench runs each request's cached generate and the engine's paged steps, on one device.
MODES = ("cached", "paged")


def run_bench(bench: BatchingBench) -> int:
    settings, dtype = bench.settings, bench.dtype
    setup = Setup(bench.frameworks, MODES, dtype, device=bench.device)
    ports: dict[str, Port] = {}
    reasons: dict[str, str] = {}  # framework -> why its rows cannot run

    def check(config: ModelConfig) -> None:  # before any tensor is read or drawn
        reasons.update(check_rules(setup, models=[("the model", config)]))
        config.validate_at(dtype)
        needed = max(longest(mixed_requests(config, bench.count)), PREFIX_LEN + PREFIX_SUFFIX[1] + PREFIX_NEW[1])
        if needed > config.max_seq_len:
            raise UserError(
                f"the bench's requests reach {needed} tokens; the model's max_seq_len is {config.max_seq_len}"
            )
        chosen = BatchSettings(**{**vars(settings), "max_length": needed}).validate(config)
        check_bytes(run_bytes(config, dtype, chosen), f"the batching bench in {dtype}")
        runnable = [name for name in bench.frameworks if name not in reasons]
        usable, unusable = usable_ports(runnable, bench.device, missing=not_installed)  # before a model is drawn
        ports.update(usable)
        reasons.update(unusable)

    check_threads(bench.threads)
    name, config, tensors = load_bench_model(bench.preset, bench.weights, dtype, check)
    use_threads(bench.threads)
    load_before = load_average()

    with make_progress(quiet=bench.json) as progress:
        task = progress.add_task("bench", total=2 * len(bench.frameworks) * len(bench.workloads))  # two runs each

        begun = [0]

        def tick(description: str) -> None:  # called as each run starts: the bar counts the ones finished
            progress.update(task, completed=begun[0], description=description)
            begun[0] += 1

        rows = run_workloads(
            list(bench.frameworks),
            list(bench.workloads),
            config,
            tensors,
            bench.count,
            settings,
            dtype,
            bench.device,
            tick,
            ports,
            reasons,
        )
        progress.update(task, completed=begun[0])  # the last run has finished too
    result = {
        "model": name,
        "dtype": dtype,
        "device": bench.device,
        "count": bench.count,
        "settings": vars(settings),
        "machine": {**machine(load_before), "threads_asked": bench.threads},
        "rows": rows,
    }
    if bench.json:
        print(json.dumps(result))
    else:
        print_tables(result)
    return 0


def machine(load_before: float | None) -> dict[str, Any]:
    """What shares the machine shows in every timing: the load average before and after, the threads."""
    threads = {name: os.environ[name] for name in THREAD_VARIABLES if name in os.environ}
    load_after = load_average()
    return {"cpu_count": os.cpu_count(), "load_average": [load_before, load_after], "threads": threads}


def choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in chosen if name not in allowed]
    if not chosen or unknown:
        raise UserError(f"--{flag} takes a comma-separated subset of {','.join(allowed)}, got {text!r}")
    return chosen


def print_tables(result: dict[str, Any]) -> None:
    from kvports.terminal import stdout_console

    console = stdout_console(width=max(160, stdout_console().width))
    live = [row for row in result["rows"] if row["available"]]
    mixed = new_table(
        f"continuous batching vs one at a time: {result['count']} requests, prompts {MIXED_PROMPT[0]}-"
        f"{MIXED_PROMPT[1]}, new tokens {MIXED_NEW[0]}-{MIXED_NEW[1]}, greedy, {result['model']} {result['dtype']} "
        f"(target: >= {TARGET_SPEEDUP:g}x)",
        ("sequential s", "batched s", "requests/s", "tokens/s", "speed-up", "same tokens", "prefill / decode s",
         "peak blocks", "compile s (seq / batched)"),
    )  # fmt: skip
    for row in (row for row in live if row["workload"] == "mixed"):
        batched, sequential = row["batched"], row["sequential"]
        compile_s = (
            "-" if batched["compile_s"] is None else f"{sequential['compile_s']:.1f} / {batched['compile_s']:.1f}"
        )
        mixed.add_row(
            row["framework"],
            f"{sequential['seconds']:.1f}",
            f"{batched['seconds']:.1f}",
            f"{sequential['requests_per_s']:.2f} -> {batched['requests_per_s']:.2f}",
            f"{sequential['tokens_per_s']:.1f} -> {batched['tokens_per_s']:.1f}",
            f"{row['speedup']:.1f}x",
            f"{row['same_tokens']}/{row['requests']}",
            f"{batched['step_seconds']['prefill']:.1f} / {batched['step_seconds']['decode']:.1f}",
            f"{batched['peak_blocks']}/{batched['num_blocks']}",
            compile_s,
        )
    prefix = new_table(
        f"prefix reuse: {result['count']} requests sharing a {PREFIX_LEN}-token prefix, batched (target: >= "
        f"{TARGET_PREFILL_RATIO:g}x fewer prefill tokens)",
        ("prefill tokens (without -> with)", "ratio", "TTFT median s", "ttft ratio", "total s", "hit rate",
         "same tokens"),
    )  # fmt: skip
    for row in (row for row in live if row["workload"] == "prefix"):
        off, on = row["without_reuse"], row["with_reuse"]
        prefix.add_row(
            row["framework"],
            f"{off['prefill_tokens']} -> {on['prefill_tokens']}",
            f"{row['prefill_ratio']:.1f}x",
            f"{off['ttft_median_s']:.2f} -> {on['ttft_median_s']:.2f}",
            f"{row['ttft_ratio']:.1f}x",
            f"{off['seconds']:.1f} -> {on['seconds']:.1f}",
            f"{on['prefix_hit_rate']:.0%}",
            f"{row['same_tokens']}/{row['requests']}",
        )
    for table in (mixed, prefix):
        if table.row_count:
            console.print(table)
    for row in result["rows"]:
        if not row["available"]:
            console.print(f"{row['framework']} {row['workload']}: not available ({row['reason']})")
    if "machine" in result:
        machine = result["machine"]
        threads = ", ".join(f"{name}={value}" for name, value in machine["threads"].items()) or "default threads"
        loads = " / ".join("-" if load is None else f"{load:.2f}" for load in machine["load_average"])
        console.print(
            f"{machine['cpu_count']} CPUs, {describe_threads(machine.get('threads_asked'))} ({threads}), "
            f"load average before / after: {loads}"
        )


def new_table(title: str, columns: tuple[str, ...]) -> Any:
    from rich.table import Table

    table = Table(title=title)
    table.add_column("framework")
    for column in columns:
        table.add_column(column, justify="right")
    return table
