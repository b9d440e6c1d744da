"""`kvports bench`: every port x {naive, cached} beside two baselines, timed step by step.

Each row runs two kinds of call, both after --warmup untimed runs, --repeats times:
- `generate()`, the whole generation as a user calls it: total time and tokens/s.
  For JAX that is the compiled loop, so the first call's extra time is its compile time.
- `generate(on_token=...)`, the same tokens with the clock read as each token reaches the host:
  the per-step latency curve, time to first token (step 0: prefill plus the first
  token) and the decode time per token (median and p90 over steps 1..N-1).
Every figure is the median over repeats; the JSON keeps every repeat. Nothing here
asserts a timing: the targets are measured and reported.

For the gpt2-small preset each row also gets a roofline: the bytes a decoded token
must read (weights plus the KV cache so far) over this machine's streaming bandwidth,
measured in the same run by a large float32 matrix-vector product.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from kvports.shared.checks import SEED_PROMPT, check_prompts
from kvports.shared.config import DTYPES, ModelConfig, kv_cache_bytes
from kvports.shared.errors import UserError
from kvports.shared.files import write_atomic
from kvports.shared.weights import DEFAULT_WEIGHTS, expected_shapes, load_weights

HELP = "time every framework x mode against the seed's cache and transformers: table, JSON, CSV, plots"

PRESETS = {
    "seed": None,  # the seed's model, shipped as the default weights file
    # GPT-2 small's sizes in the seed's architecture (exact GELU, untied head), random weights.
    "gpt2-small": ModelConfig(vocab_size=50257, d_model=768, n_heads=12, n_layers=12, max_seq_len=1024),
}
MODES = ("naive", "cached")
MATVEC_SHAPE = (8192, 8192)  # float32: 256 MiB, far beyond any cache level
MATVEC_REPEATS = 7


@dataclass(frozen=True)
class Runner:
    """One framework (or baseline) as the bench drives it."""

    framework: str  # what the JSON calls it
    module: str  # a port's or a baseline's module, imported when its rows run
    modes: Tuple[str, ...]
    variant: Optional[str] = None  # "torch.compile" for the optional compiled row
    compiles: bool = False  # the first call compiles: report first call minus steady state as compile_s
    gpu: bool = True  # runs on a GPU with --device gpu (NumPy stays on the CPU)

    @property
    def label(self) -> str:
        return self.framework if self.variant is None else f"{self.framework} ({self.variant})"


RUNNERS = (
    Runner("torch", "kvports.torch_impl.port", MODES),
    Runner("jax", "kvports.jax_impl.port", MODES, compiles=True),
    Runner("numpy", "kvports.numpy_impl.port", MODES, gpu=False),
    Runner("seed-concat", "kvports.baselines.seed_concat", ("cached",)),
    Runner("transformers", "kvports.baselines.hf_gpt2", ("cached",)),
)
COMPILED_RUNNER = Runner("torch", "kvports.baselines.torch_compile", ("cached",), variant="torch.compile", compiles=True)
FRAMEWORKS = tuple(runner.framework for runner in RUNNERS)

PREALLOCATED = ("writes a cache preallocated for P + N positions and attends over the slots filled so far "
                "(copied beside each step's k and v)")
STATIC_SLOTS = ("attends over all P + N preallocated slots (static shapes under jit), the empty ones masked: its "
                "per-step cost is set by P + N, not the position")
NOTES = {
    ("jax", "naive"): "per-step times are jitted forwards over the history padded to the next power of two (one compile "
                      "per length bucket, in warm-up), so they grow in steps; total_s is generate()'s compiled loop, "
                      "which recomputes the whole [B, P + N] buffer at every step",
    ("jax", "cached"): STATIC_SLOTS + "; per-step times are the jitted prefill and decode_step, one call each; total_s "
                       "is the compiled loop (steady state); compile_s = first call minus steady state",
    ("torch", "cached"): PREALLOCATED,
    ("numpy", "cached"): PREALLOCATED,
    ("seed-concat", "cached"): "the seed's cache: torch.cat copies the whole history and triu rebuilds the mask "
                               "every step",
    ("transformers", "cached"): "GPT2LMHeadModel.generate(do_sample=False) on the same weights; per-step times from "
                                "its streamer",
}


# ---------------------------------------------------------------- arguments and inputs

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=tuple(PRESETS), default="seed",
                        help="seed: the seed's model; gpt2-small: GPT-2 small's sizes, random weights (default seed)")
    parser.add_argument("--weights", type=Path, default=None, help="time this safetensors file instead of a preset")
    parser.add_argument("--batch", type=int, default=1, help="prompts per batch (default 1)")
    parser.add_argument("--prompt-len", type=int, default=len(SEED_PROMPT), metavar="P",
                        help=f"prompt tokens: the seed's prompt, repeated to length P (default {len(SEED_PROMPT)})")
    parser.add_argument("--new-tokens", type=int, default=100, metavar="N", help="tokens to generate (default 100)")
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS),
                        help=f"comma-separated subset of {','.join(FRAMEWORKS)} (default all)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of naive,cached (default both)")
    parser.add_argument("--compile", action="store_true", help="add a torch.compile row (torch cached, compiled)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure; figures are medians (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before timing (default 1)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype (default float32)")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="gpu: torch and JAX rows on a GPU, reported unavailable where there is none (default cpu)")
    parser.add_argument("--sweep", default=None, metavar="N1,N2,...",
                        help="also time generate() at these new-token counts, for the total-time log-log plot "
                             "(default with --plot: N/16, N/8, N/4, N/2, N)")
    parser.add_argument("--roofline", action="store_true",
                        help="measure bandwidth and a roofline for any preset (always on for gpt2-small)")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print one JSON object on stdout (no table, no progress bar)")
    output.add_argument("--csv", action="store_true", help="print one CSV line per row on stdout (no table)")
    parser.add_argument("--plot", type=Path, default=None, metavar="DIR", help="write PNG plots into DIR")


def parse_choices(text: str, allowed: Sequence[str], what: str) -> List[str]:
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    if not chosen:
        raise UserError(f"--{what} is empty: give some of {','.join(allowed)}")
    for name in chosen:
        if name not in allowed:
            raise UserError(f"unknown {what[:-1]} {name!r}; known: {', '.join(allowed)}")
    return [name for name in allowed if name in chosen]


def check_at_least(name: str, value: int, limit: int, why: str = "") -> None:
    if value < limit:
        raise UserError(f"{name} {value} is below {limit}{why}")


def default_sweep(new_tokens: int) -> List[int]:
    return sorted({max(2, round(new_tokens / 2 ** k)) for k in range(5)})


def parse_sweep(text: Optional[str], new_tokens: int, prompt_len: int, config: ModelConfig, plot: bool) -> List[int]:
    if text is None:
        return default_sweep(new_tokens) if plot else []
    values = []
    for part in text.split(","):
        try:
            values.append(int(part.strip(), 10))
        except ValueError:
            raise UserError(f"--sweep value {part.strip()!r} is not an integer") from None
    for value in values:
        check_at_least("--sweep value", value, 2)
        if prompt_len + value > config.max_seq_len:
            raise UserError(f"--sweep value {value} + prompt length {prompt_len} exceeds max_seq_len {config.max_seq_len}")
    return sorted(set(values))


def random_weights(config: ModelConfig, seed: int = 0) -> Dict[str, np.ndarray]:
    """GPT-2's initialisation in NumPy (N(0, 0.02) matrices, zero biases, unit norms): timing
    needs a model of the right size, not a trained one, and NumPy draws it in seconds."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith(".bias"):
            tensors[name] = np.zeros(shape, dtype=np.float32)
        elif len(shape) == 1:
            tensors[name] = np.ones(shape, dtype=np.float32)
        else:
            tensors[name] = rng.standard_normal(shape, dtype=np.float32)
            tensors[name] *= 0.02
    return tensors


def load_bench_model(args: argparse.Namespace) -> Tuple[str, ModelConfig, Dict[str, np.ndarray]]:
    if args.weights is not None:
        config, tensors = load_weights(args.weights)
        return args.weights.name, config, tensors
    if PRESETS[args.preset] is None:
        config, tensors = load_weights(DEFAULT_WEIGHTS)
        return args.preset, config, tensors
    config = PRESETS[args.preset]
    return args.preset, config, random_weights(config)


def bench_prompts(config: ModelConfig, batch: int, prompt_len: int, new_tokens: int) -> np.ndarray:
    # The seed's prompt, repeated to length; ids past a small vocab wrap into it.
    row = [int(token) % config.vocab_size for token in np.resize(np.asarray(SEED_PROMPT), prompt_len)]
    return check_prompts([row] * batch, config, new_tokens)  # [B, P]


# ---------------------------------------------------------------- measuring

def median(values: Sequence[float]) -> float:
    return float(np.median(np.asarray(values, dtype=np.float64)))


def time_generate(module, model, prompts: np.ndarray, new_tokens: int, mode: str) -> Tuple[np.ndarray, float]:
    start = time.perf_counter()
    tokens, _ = module.generate(model, prompts, new_tokens, mode)
    module.synchronize(model)
    return tokens, time.perf_counter() - start


def time_stream(module, model, prompts: np.ndarray, new_tokens: int, mode: str) -> Tuple[np.ndarray, List[float]]:
    """Milliseconds per step: step 0 ends when the first new token is on the host."""
    stamps: List[float] = []
    start = time.perf_counter()
    tokens, _ = module.generate(model, prompts, new_tokens, mode, on_token=lambda token: stamps.append(time.perf_counter()))
    if len(stamps) != new_tokens:
        raise RuntimeError(f"{module.NAME}: generate(on_token=...) reported {len(stamps)} tokens, expected {new_tokens}")
    return tokens, [1e3 * step for step in np.diff([start] + stamps)]


def step_figures(step_ms: Sequence[float]) -> dict:
    decode = np.asarray(step_ms[1:], dtype=np.float64)  # [N - 1]
    return {"ttft_ms": float(step_ms[0]), "decode_ms_per_token": float(np.median(decode)),
            "decode_ms_p90": float(np.percentile(decode, 90))}


def fit_slope(new_tokens: Sequence[int], seconds: Sequence[float]) -> Optional[float]:
    """Slope of log(total time) against log(new tokens): ~1 for flat per-step cost, ->2 for linear growth."""
    if len(new_tokens) < 2:
        return None
    slope, _ = np.polyfit(np.log(np.asarray(new_tokens, dtype=np.float64)), np.log(np.asarray(seconds, dtype=np.float64)), 1)
    return float(slope)


def measure_row(runner: Runner, module, model, mode: str, prompts: np.ndarray, args, sweep: List[int],
                tick: Callable[[str], None]) -> dict:
    new_tokens = args.new_tokens
    label = f"{runner.label} {mode}"
    _, first_call_s = time_generate(module, model, prompts, new_tokens, mode)  # warm-up 1; JAX compiles here
    tick(f"{label} warm-up")
    for _ in range(args.warmup - 1):
        time_generate(module, model, prompts, new_tokens, mode)
        tick(f"{label} warm-up")
    for _ in range(args.warmup):
        time_stream(module, model, prompts, new_tokens, mode)
        tick(f"{label} warm-up")
    repeats, tokens = [], None
    for index in range(args.repeats):
        tokens, total_s = time_generate(module, model, prompts, new_tokens, mode)
        stream_tokens, step_ms = time_stream(module, model, prompts, new_tokens, mode)
        repeats.append({"total_s": total_s, **step_figures(step_ms), "per_step_ms": step_ms,
                        "stream_tokens_equal": bool(np.array_equal(stream_tokens, tokens))})
        tick(f"{label} {index + 1}/{args.repeats}")
    total_s = median([r["total_s"] for r in repeats])
    row = {
        "ttft_ms": median([r["ttft_ms"] for r in repeats]),
        "decode_ms_per_token": median([r["decode_ms_per_token"] for r in repeats]),
        "decode_ms_p90": median([r["decode_ms_p90"] for r in repeats]),
        "tokens_per_s": prompts.shape[0] * new_tokens / total_s,
        "total_s": total_s,
        "total_ms_per_token": 1e3 * total_s / new_tokens,  # for JAX: the compiled loop's steady state
        "first_call_s": first_call_s,
        "compile_s": max(0.0, first_call_s - total_s) if runner.compiles else None,
        "per_step_ms": np.median(np.asarray([r["per_step_ms"] for r in repeats]), axis=0).tolist(),  # [N]
        "repeats": repeats,
        "tokens": tokens,
    }
    if sweep:
        sweep_s = []
        for n in sweep:
            if n == new_tokens:  # measured above, the same way
                sweep_s.append(total_s)
            else:
                for _ in range(args.warmup):
                    time_generate(module, model, prompts, n, mode)  # a new n is a new compile for JAX
                sweep_s.append(median([time_generate(module, model, prompts, n, mode)[1] for _ in range(args.repeats)]))
            tick(f"{label} sweep {n}")
        row["sweep"] = {"new_tokens": list(sweep), "total_s": sweep_s, "slope": fit_slope(sweep, sweep_s)}
    else:
        row["sweep"] = None
    return row


def matvec_bandwidth(seconds: Sequence[float]) -> float:
    """Bytes per second of the matrix a matrix-vector product streams (the vectors are negligible)."""
    rows, cols = MATVEC_SHAPE
    return rows * cols * 4 / median(seconds)


def numpy_matvec_seconds(rows: int, cols: int, repeats: int) -> List[float]:
    matrix = np.ones((rows, cols), dtype=np.float32)  # [rows, cols]
    vector = np.ones(cols, dtype=np.float32)  # [cols]
    seconds = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        matrix @ vector  # [rows]
        seconds.append(time.perf_counter() - start)
    return seconds[1:]  # the first call pays for page faults and thread start-up


def decode_bytes(config: ModelConfig, tensors: Dict[str, np.ndarray], batch: int, prompt_len: int,
                 new_tokens: int, itemsize: int) -> float:
    """Bytes one decode step must read at the least, averaged over steps 1..N-1: every weight
    once (the embedding tables only for their looked-up rows, unless the head reuses `emb`),
    plus the keys and values of every earlier position."""
    gathered = {"emb.weight", "pos.weight"} - (set() if not config.tie_embeddings else {"emb.weight"})
    weights = sum(array.size for name, array in tensors.items() if name not in gathered) * itemsize
    weights += batch * config.d_model * itemsize * len(gathered & set(tensors))  # the rows looked up
    positions = np.arange(prompt_len + 1, prompt_len + new_tokens)  # context length at decode steps 1..N-1
    per_position = kv_cache_bytes(config, batch, 1, itemsize)  # k and v of one position, every layer
    return float(weights + per_position * positions.mean())


# ---------------------------------------------------------------- running the rows

def import_runner(runner: Runner):
    """The runner's module, or the reason it cannot run."""
    import importlib

    from kvports.shared.ports import PortUnavailable, load_port

    try:
        if runner.module.endswith(".port") and runner.variant is None:
            return load_port(runner.framework), None
        return importlib.import_module(runner.module), None
    except PortUnavailable as exc:
        return None, exc.reason
    except ImportError as exc:
        return None, f"not installed ({exc})"


MEASURES = ("ttft_ms", "decode_ms_per_token", "decode_ms_p90", "tokens_per_s", "total_s", "compile_s", "kv_cache_bytes",
            "roofline_ratio")


def unavailable_row(runner: Runner, mode: str, reason: str) -> dict:
    # Every field a row has, empty: a reader of the JSON need not special-case it.
    return {"framework": runner.framework, "variant": runner.variant, "mode": mode, "available": False, "reason": reason,
            **dict.fromkeys(MEASURES), "per_step_ms": []}


def run_rows(runners: List[Runner], modes: List[str], config: ModelConfig, tensors: Dict[str, np.ndarray],
             prompts: np.ndarray, args, sweep: List[int], roofline: bool, progress) -> Tuple[List[dict], dict]:
    import gc

    itemsize = np.dtype(args.dtype).itemsize
    B, P = prompts.shape
    N = args.new_tokens
    task = progress.add_task("bench", total=sum(
        (2 * args.warmup + args.repeats + len(sweep)) * len([m for m in runner.modes if m in modes]) for runner in runners))
    tick = lambda description: progress.update(task, advance=1, description=description)
    rows: List[dict] = []
    bandwidth: Dict[str, float] = {}
    matvec: Dict[str, List[float]] = {}
    bandwidth_device: Dict[str, str] = {}
    if roofline:
        progress.update(task, description="numpy bandwidth")
        matvec["numpy"] = numpy_matvec_seconds(*MATVEC_SHAPE, MATVEC_REPEATS)
        bandwidth["numpy"] = matvec_bandwidth(matvec["numpy"])
        bandwidth_device["numpy"] = "cpu"
    versions: Dict[str, str] = {"numpy": np.__version__}
    for runner in runners:
        runner_modes = [mode for mode in runner.modes if mode in modes]
        if not runner_modes:
            continue
        device = args.device if runner.gpu else "cpu"
        module, reason = import_runner(runner)
        model = None
        if module is not None:
            try:
                model = module.load_model(config, tensors, args.dtype, device)
            except Exception as exc:  # a missing GPU, or a config this baseline cannot run
                reason = f"{type(exc).__name__}: {exc}"
        if model is None:
            rows.extend(unavailable_row(runner, mode, reason) for mode in runner_modes)
            progress.update(task, advance=(2 * args.warmup + args.repeats + len(sweep)) * len(runner_modes))
            continue
        versions.update(module.versions())
        library = "torch" if runner.framework in ("seed-concat", "transformers") else runner.framework
        if roofline and library not in bandwidth:
            progress.update(task, description=f"{library} bandwidth")
            matvec[library] = module.matvec_seconds(*MATVEC_SHAPE, MATVEC_REPEATS, device)
            bandwidth[library] = matvec_bandwidth(matvec[library])
            bandwidth_device[library] = device
        for mode in runner_modes:
            row = {"framework": runner.framework, "variant": runner.variant, "mode": mode, "available": True,
                   "device": device, "dtype": args.dtype}
            row.update(measure_row(runner, module, model, mode, prompts, args, sweep, tick))
            row["kv_cache_bytes"] = cache_bytes_held(runner, mode, config, B, P, N, itemsize)
            row["note"] = NOTES.get((runner.framework, mode)) if runner.variant is None else compiled_note()
            rows.append(row)
        del model
        gc.collect()  # gpt2-small: free one framework's copy of the weights before the next loads
    # One roofline per device: the best streaming bandwidth any framework reached on it.
    step_bytes = decode_bytes(config, tensors, B, P, N, itemsize) if roofline else None
    best = {}
    for name, value in bandwidth.items():
        best[bandwidth_device[name]] = max(value, best.get(bandwidth_device[name], 0.0))
    for row in rows:
        if row["available"]:
            row["roofline_ms"] = 1e3 * step_bytes / best[row["device"]] if row["device"] in best else None
            row["roofline_ratio"] = None if row["roofline_ms"] is None else row["decode_ms_per_token"] / row["roofline_ms"]
    machine = {"bandwidth_gb_s": {f"{name} ({bandwidth_device[name]})": value / 1e9 for name, value in bandwidth.items()} or None,
               "roofline_bandwidth_gb_s": {device: value / 1e9 for device, value in best.items()} or None,
               "decode_bytes_per_step": step_bytes,
               "matvec": {"shape": list(MATVEC_SHAPE), "dtype": "float32", "seconds": matvec} if matvec else None}
    add_comparisons(rows)
    return rows, {"versions": versions, **machine}


def compiled_note() -> str:
    return "torch.compile of the reference model's forward; compile_s = first call minus steady state"


def cache_bytes_held(runner: Runner, mode: str, config: ModelConfig, batch: int, prompt_len: int, new_tokens: int,
                     itemsize: int) -> int:
    if mode == "naive":
        return 0  # no cache: every step recomputes k and v for the whole history
    if runner.framework in ("seed-concat", "transformers"):
        # Grown, not preallocated: the last token is never fed back, so P + N - 1 positions.
        return kv_cache_bytes(config, batch, prompt_len + new_tokens - 1, itemsize)
    return kv_cache_bytes(config, batch, prompt_len + new_tokens, itemsize)


def add_comparisons(rows: List[dict]) -> None:
    """Speed-ups the targets name: decode per token against seed-concat, total against the same port's naive."""
    live = [row for row in rows if row["available"]]
    seed = next((row for row in live if row["framework"] == "seed-concat"), None)
    reference = next((row for row in live if row["framework"] == "torch" and row["variant"] is None), live[0] if live else None)
    for row in live:
        row["decode_speedup_vs_seed_concat"] = None if seed is None else seed["decode_ms_per_token"] / row["decode_ms_per_token"]
        naive = next((r for r in live if r["framework"] == row["framework"] and r["variant"] is None and r["mode"] == "naive"), None)
        row["total_speedup_vs_naive"] = None if naive is None or row["mode"] == "naive" else naive["total_s"] / row["total_s"]
        row["tokens_agree"] = bool(np.array_equal(row["tokens"], reference["tokens"]))
        row["tokens_reference"] = f"{reference['framework']} {reference['mode']}"
    for row in live:
        del row["tokens"]


def load_average() -> Optional[float]:
    """The 1-minute load average: other work on the machine shows up in every timing."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def threads_info() -> dict:
    info = {"cpu_count": os.cpu_count()}
    if hasattr(os, "sched_getaffinity"):
        info["usable_cpus"] = len(os.sched_getaffinity(0))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "XLA_FLAGS"):
        if name in os.environ:
            info[name] = os.environ[name]
    if "torch" in sys.modules:  # only if a row loaded it: the bench itself stays NumPy-only
        info["torch"] = sys.modules["torch"].get_num_threads()
    return info


def targets(rows: List[dict], settings: dict) -> List[dict]:
    """The issue's targets, at the settings they were set for (seed preset, batch 1; 500 new
    tokens for cached against naive; gpt2-small for the roofline). Reported, never asserted."""
    live = {(row["framework"], row["variant"], row["mode"]): row for row in rows if row["available"]}
    found = []

    def get(framework: str, mode: str, key: str) -> Optional[float]:
        row = live.get((framework, None, mode))
        return None if row is None else row.get(key)

    def add(name: str, value: Optional[float], threshold: float, higher_is_better: bool = True) -> None:
        if value is not None:
            met = value >= threshold if higher_is_better else value <= threshold
            found.append({"target": name, "value": value, "threshold": threshold, "met": bool(met)})

    seed_run = settings["preset"] == "seed" and settings["batch"] == 1
    if seed_run:
        for framework, threshold in (("torch", 2.0), ("jax", 10.0), ("numpy", 1.5)):
            add(f"{framework} cached decode ms/token, x faster than seed-concat",
                get(framework, "cached", "decode_speedup_vs_seed_concat"), threshold)
        seed_total, jax_total = get("seed-concat", "cached", "total_s"), get("jax", "cached", "total_s")
        if seed_total is not None and jax_total is not None:  # JAX's steady state is its compiled loop
            add("jax cached compiled loop, total x faster than seed-concat", seed_total / jax_total, 10.0)
    if seed_run and settings["new_tokens"] >= 500:
        for framework in ("torch", "jax", "numpy"):
            add(f"{framework} cached total, x faster than naive", get(framework, "cached", "total_speedup_vs_naive"), 10.0)
        for framework in ("torch", "jax", "numpy"):
            naive = (get(framework, "naive", "sweep") or {}).get("slope")
            cached = (get(framework, "cached", "sweep") or {}).get("slope")
            if naive is not None and cached is not None:
                add(f"{framework} log-log slope of total time, naive minus cached", naive - cached, 0.3)
    if settings["preset"] == "gpt2-small" and settings["batch"] == 1:
        ratios = [row["roofline_ratio"] for row in live.values() if row["roofline_ratio"] is not None and row["mode"] == "cached"]
        if ratios:
            add("best cached decode ms/token, x roofline", min(ratios), 1.25, higher_is_better=False)
        torch_ms, hf_ms = get("torch", "cached", "decode_ms_per_token"), get("transformers", "cached", "decode_ms_per_token")
        if torch_ms is not None and hf_ms is not None:
            add("torch cached decode ms/token, x faster than transformers", hf_ms / torch_ms, 1.0)
    return found


# ---------------------------------------------------------------- output

CSV_FIELDS = ("framework", "variant", "mode", "available", "device", "dtype", "ttft_ms", "decode_ms_per_token",
              "decode_ms_p90", "tokens_per_s", "total_s", "compile_s", "kv_cache_bytes", "roofline_ms", "roofline_ratio",
              "decode_speedup_vs_seed_concat", "total_speedup_vs_naive", "tokens_agree", "reason")


def to_csv(result: dict) -> str:
    settings = result["settings"]
    columns = ("preset", "batch", "prompt_len", "new_tokens") + CSV_FIELDS
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in result["rows"]:
        writer.writerow({**{key: settings[key] for key in columns[:4]}, **row})
    return buffer.getvalue()


def fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def fmt_bytes(count: int) -> str:
    if count == 0:
        return "none"
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    s, rows = result["settings"], result["rows"]
    live = [row for row in rows if row["available"]]
    title = (f"kvports bench: {s['preset']} ({s['parameters'] / 1e6:.1f}M parameters), batch {s['batch']}, "
             f"prompt {s['prompt_len']}, {s['new_tokens']} new tokens, {s['dtype']}, {s['device']}; "
             f"median of {s['repeats']} after {s['warmup']} warm-up")
    columns = ["framework", "mode", "ttft ms", "decode ms", "p90 ms", "tok/s", "total s", "compile s", "KV cache",
               "vs seed", "vs naive"]
    roofline = any(row["roofline_ratio"] is not None for row in live)
    swept = any(row["sweep"] for row in live)
    columns += ["roofline"] * roofline + ["slope"] * swept
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if column in ("framework", "mode") else "right", no_wrap=True)
    notes: List[str] = []
    for row in rows:
        name = row["framework"] if row["variant"] is None else f"{row['framework']} ({row['variant']})"
        if not row["available"]:
            table.add_row(name, row["mode"], f"[dim]unavailable: {row['reason']}"[:70], *["-"] * (len(columns) - 3))
            continue
        if row["note"]:
            if row["note"] not in notes:
                notes.append(row["note"])
            name += f" [{notes.index(row['note']) + 1}]"
        if not row["tokens_agree"]:
            name += " *"
        cells = [name, row["mode"], fmt(row["ttft_ms"], ".2f"), fmt(row["decode_ms_per_token"], ".3f"),
                 fmt(row["decode_ms_p90"], ".3f"), fmt(row["tokens_per_s"], ",.0f"), fmt(row["total_s"], ".3f"),
                 fmt(row["compile_s"], ".2f"), fmt_bytes(row["kv_cache_bytes"]),
                 fmt(row["decode_speedup_vs_seed_concat"], ".2f", "x"), fmt(row["total_speedup_vs_naive"], ".1f", "x")]
        cells += [fmt(row["roofline_ratio"], ".2f", "x")] * roofline
        cells += [fmt((row["sweep"] or {}).get("slope"), ".2f")] * swept
        table.add_row(*cells)
    console = Console(width=max(160, Console().width))  # the table's width, even when piped
    console.print(table)
    console.print("ttft: time to first token (prefill); decode: median ms per decode step, p90 its 90th percentile; "
                  "tok/s: batch x new tokens / total s; vs seed: seed-concat's decode ms over this row's; vs naive: "
                  "the same port's naive total over this row's"
                  + "; roofline: decode ms over the roofline's" * roofline
                  + "; slope: fitted log-log exponent of total time against new tokens" * swept,
                  highlight=False, markup=False)
    for index, note in enumerate(notes, 1):
        console.print(f"[{index}] {note}", highlight=False, markup=False)
    if any(not row["tokens_agree"] for row in live):
        console.print(f"* tokens differ from {live[0]['tokens_reference']}'s (float32 near-ties part frameworks; "
                      "kvports compare reports the step and margin)", highlight=False, markup=False)
    machine = result["machine"]
    if machine["bandwidth_gb_s"]:
        measured = ", ".join(f"{name} {value:.1f}" for name, value in machine["bandwidth_gb_s"].items())
        console.print(f"streaming bandwidth, GB/s, float32 {MATVEC_SHAPE[0]}x{MATVEC_SHAPE[1]} matrix-vector product: "
                      f"{measured}. Roofline: {machine['decode_bytes_per_step'] / 1e6:.1f} MB read per decode step "
                      "(weights + KV cache so far) over the best bandwidth on the row's device.",
                      highlight=False, markup=False)
    threads = ", ".join(f"{name} {value}" for name, value in s["threads"].items())
    console.print(f"threads: {threads}; load average before / after: {machine['load_average'][0]} / "
                  f"{machine['load_average'][1]}", highlight=False, markup=False)
    for target in result["targets"]:
        verdict = "met" if target["met"] else "MISSED"
        console.print(f"target: {target['target']}: {target['value']:.2f} (target {target['threshold']}): {verdict}",
                      highlight=False, markup=False)


def write_plots(result: dict, folder: Path) -> List[Path]:
    """Per-step latency against position, one panel per port; total time against new tokens, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    s = result["settings"]
    rows = [row for row in result["rows"] if row["available"]]
    stem = s["preset"]
    written = []
    colors = {("naive", None): "tab:red", ("cached", None): "tab:blue", ("cached", "torch.compile"): "tab:purple"}
    baseline_colors = {"seed-concat": "tab:orange", "transformers": "tab:green"}
    framework_colors = {"torch": "tab:blue", "jax": "tab:red", "numpy": "tab:green", "seed-concat": "tab:orange",
                        "transformers": "tab:gray", "torch.compile": "tab:purple"}

    panels = [name for name in ("torch", "jax", "numpy") if any(row["framework"] == name for row in rows)]
    if panels:
        figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
        for axis, name in zip(axes[0], panels):
            shown = [row for row in rows if row["framework"] == name]
            if name == "torch":  # the baselines are PyTorch too: they share its panel
                shown += [row for row in rows if row["framework"] in baseline_colors]
            for row in shown:
                steps = np.asarray(row["per_step_ms"][1:])  # [N - 1]; step 0 (prefill) is in the table
                positions = s["prompt_len"] + np.arange(1, s["new_tokens"])  # context length at each step
                color = baseline_colors.get(row["framework"], colors.get((row["mode"], row["variant"]), "tab:gray"))
                label = row["mode"] if row["framework"] == name and row["variant"] is None else \
                    f"{row['framework'] if row['variant'] is None else row['variant']} {row['mode']}"
                axis.plot(positions, steps, color=color, label=label, linewidth=1)
            axis.set_title(name)
            axis.set_xlabel("position (tokens in context)")
            axis.set_ylabel("ms per step")
            axis.set_ylim(bottom=0)
            axis.grid(alpha=0.3)
            axis.legend(fontsize=8)
        figure.suptitle(f"per-step decode latency, {stem}, batch {s['batch']}, prompt {s['prompt_len']}, {s['dtype']}, "
                        f"{s['device']} (median of {s['repeats']})", fontsize=10)
        figure.tight_layout()
        written.append(save_figure(figure, folder / f"per_step_{stem}.png"))
        plt.close(figure)

    swept = [row for row in rows if row.get("sweep")]
    if swept:
        figure, axis = plt.subplots(figsize=(7, 5))
        for row in swept:
            sweep = row["sweep"]
            name = row["framework"] if row["variant"] is None else row["variant"]
            naive = row["mode"] == "naive"
            axis.loglog(sweep["new_tokens"], sweep["total_s"], "--o" if naive else "-s", markersize=3, linewidth=1,
                        color=framework_colors.get(name, "tab:gray"), label=f"{name} {row['mode']} (slope {sweep['slope']:.2f})")
        axis.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.set_xticks(swept[0]["sweep"]["new_tokens"])
        axis.set_xlabel("new tokens")
        axis.set_ylabel("total seconds")
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=7)
        axis.set_title(f"total time against new tokens, {stem}, prompt {s['prompt_len']} (median of {s['repeats']})\n"
                       "slope: fitted log-log exponent; dashed: naive", fontsize=9)
        figure.tight_layout()
        written.append(save_figure(figure, folder / f"total_vs_tokens_{stem}.png"))
        plt.close(figure)
    return written


def save_figure(figure, path: Path) -> Path:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    write_atomic(path, buffer.getvalue())
    return path


# ---------------------------------------------------------------- the command

def make_progress(quiet: bool):
    from kvports.shared.cli import make_progress as cli_progress

    return cli_progress(quiet)


def run(args: argparse.Namespace) -> int:
    check_at_least("--batch", args.batch, 1)
    check_at_least("--prompt-len", args.prompt_len, 1)
    check_at_least("new tokens", args.new_tokens, 2, ": decode timing needs a step after the first token")
    check_at_least("--repeats", args.repeats, 1)
    check_at_least("--warmup", args.warmup, 1, ": the first call (and JAX's compile) must stay out of the figures")
    frameworks = parse_choices(args.frameworks, FRAMEWORKS, "frameworks")
    modes = parse_choices(args.modes, MODES, "modes")
    if args.plot is not None and not args.plot.parent.is_dir():
        raise UserError(f"folder {str(args.plot.parent)!r} does not exist (needed for --plot {str(args.plot)!r})")
    preset, config, tensors = load_bench_model(args)
    prompts = bench_prompts(config, args.batch, args.prompt_len, args.new_tokens)  # [B, P]
    sweep = parse_sweep(args.sweep, args.new_tokens, args.prompt_len, config, args.plot is not None)
    if args.dtype != "float32":
        tensors = {name: array.astype(args.dtype) for name, array in tensors.items()}
    roofline = args.roofline or preset == "gpt2-small"
    runners = [runner for runner in RUNNERS if runner.framework in frameworks]
    if args.compile:
        runners.append(COMPILED_RUNNER)
    settings = {"preset": preset, "config": json.loads(config.to_json()), "parameters": int(sum(a.size for a in tensors.values())),
                "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "dtype": args.dtype,
                "device": args.device, "repeats": args.repeats, "warmup": args.warmup, "sweep": sweep,
                "prompt": prompts[0].tolist()}
    start, load_before = time.perf_counter(), load_average()
    with make_progress(args.json or args.csv) as progress:
        rows, machine_info = run_rows(runners, modes, config, tensors, prompts, args, sweep, roofline, progress)
    settings["versions"] = machine_info.pop("versions")
    settings["threads"] = threads_info()
    machine = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
               "python": platform.python_version(), "cpu_count": os.cpu_count(), **machine_info,
               "bench_seconds": time.perf_counter() - start, "load_average": [load_before, load_average()]}
    result = {"settings": settings, "machine": machine, "rows": rows}
    result["targets"] = targets(rows, settings)
    if args.plot is not None:
        args.plot.mkdir(exist_ok=True)
        result["plots"] = [str(path) for path in write_plots(result, args.plot)]
    if args.json:
        print(json.dumps(result))
    elif args.csv:
        sys.stdout.write(to_csv(result))
    else:
        print_table(result)
        for path in result.get("plots", []):
            print(f"wrote {path}")
    return 0
