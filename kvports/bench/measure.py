"""The clocks: one row's timings (whole generations and per-step), the machine's streaming
bandwidth, and the bytes a decode step must read (the roofline's numerator)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvports.bench.runners import Runner
from kvports.generating import Draft, RunInputs, generate
from kvports.loading import LoadedModel
from kvports.shared.config import ModelConfig, kv_cache_bytes
from kvports.shared.contract import OnToken, Timed
from kvports.shared.generation import GenerationConfig

MATVEC_SHAPE = (8192, 8192)  # float32: 256 MiB, far beyond any cache level
MATVEC_REPEATS = 7


def median(values: Sequence[float]) -> float:
    return float(np.median(np.asarray(values, dtype=np.float64)))


@dataclass
class RowCall:
    """How a row generates: a port's model through the run layer (`generating.generate`, any mode; with
    mode "speculative" its draft loaded onto it beforehand), or a baseline's or a peer's own
    `generate(..., mode)`."""

    mode: str
    loaded: LoadedModel | None = None  # a port's model; None: the module's own generate
    draft: Draft | None = None  # mode speculative: the draft's source (a weights file, or ngram), K and n
    speculative: dict[str, Any] | None = None  # the last speculative call's proposals, acceptances, forwards

    def __call__(
        self, module: Any, model: Any, prompts: np.ndarray, new_tokens: int, on_token: OnToken | None = None
    ) -> tuple[np.ndarray, float]:
        """(tokens [B, P + N], seconds until the device was done)."""
        if self.loaded is not None:
            inputs = RunInputs(self.loaded.framework, self.mode, GenerationConfig(new_tokens), draft=self.draft)
            result = generate(self.loaded, prompts, inputs, on_token=on_token)
            assert result.padded is not None
            self.speculative = result.speculative
            return result.padded, result.seconds
        start = time.perf_counter()
        tokens, _ = module.generate(model, prompts, new_tokens, self.mode, on_token=on_token)
        module.synchronize(model)
        return tokens, time.perf_counter() - start


def time_generate(
    module: Timed, model: Any, prompts: np.ndarray, new_tokens: int, call: RowCall
) -> tuple[np.ndarray, float]:
    return call(module, model, prompts, new_tokens)


def time_stream(
    module: Timed, model: Any, prompts: np.ndarray, new_tokens: int, call: RowCall
) -> tuple[np.ndarray, list[float]]:
    """Milliseconds per step: step 0 ends when the first new token is on the host."""
    stamps: list[float] = []

    def on_token(token: np.ndarray) -> None:
        stamps.append(time.perf_counter())

    start = time.perf_counter()
    tokens, _ = call(module, model, prompts, new_tokens, on_token=on_token)
    if len(stamps) != new_tokens:
        raise RuntimeError(f"{module.NAME}: generate called on_token {len(stamps)} times, expected {new_tokens}")
    return tokens, [1e3 * step for step in np.diff([start] + stamps)]


def step_figures(step_ms: Sequence[float]) -> dict[str, float | None]:
    decode = np.asarray(step_ms[1:], dtype=np.float64)  # [N - 1]
    return {
        "ttft_ms": float(step_ms[0]),
        "decode_ms_per_token": float(np.median(decode)),
        "decode_ms_p90": float(np.percentile(decode, 90)),
    }


def speculative_step_figures(step_ms: Sequence[float], streams: bool) -> dict[str, float | None]:
    """Speculative tokens reach the host in bursts (a round's accepted proposals at once), so
    a step's time says little: decode is the mean per token after the first, and p90 is not
    given. A port whose loop is one compiled call (`streams` False) hands every token over
    when it returns: only its total time per token is measured."""
    if not streams:
        return {"ttft_ms": None, "decode_ms_per_token": None, "decode_ms_p90": None}
    return {
        "ttft_ms": float(step_ms[0]),
        "decode_ms_per_token": float(np.sum(step_ms[1:]) / max(len(step_ms) - 1, 1)),
        "decode_ms_p90": None,
    }


def fit_slope(new_tokens: Sequence[int], seconds: Sequence[float]) -> float | None:
    """Slope of log(total time) against log(new tokens): ~1 for flat per-step cost, ->2 for linear growth."""
    if len(new_tokens) < 2:
        return None
    slope, _ = np.polyfit(
        np.log(np.asarray(new_tokens, dtype=np.float64)), np.log(np.asarray(seconds, dtype=np.float64)), 1
    )
    return float(slope)


def summarize(repeats: list[dict[str, Any]], batch: int, new_tokens: int, prompt_tokens: int) -> dict[str, Any]:
    """A row's figures from its repeats (one run's, or every round's together): each the median over
    repeats. tg: generated tokens/s over decode steps 1..N-1 of the stream (llama-bench's tg: the prompt
    excluded); pp: prompt tokens/s of a `prompt_tokens`-token prefill (llama-bench's pp), where timed."""

    def median_of(key: str) -> float | None:
        values = [r[key] for r in repeats if r.get(key) is not None]
        return median(values) if values else None

    total_s = median_of("total_s")
    assert total_s is not None  # every repeat times a whole generation
    pp_s = median_of("pp_s") if prompt_tokens else None
    curves = [r["per_step_ms"] for r in repeats if r["per_step_ms"]]
    return {
        "ttft_ms": median_of("ttft_ms"),
        "decode_ms_per_token": median_of("decode_ms_per_token"),
        "decode_ms_p90": median_of("decode_ms_p90"),
        "tokens_per_s": batch * new_tokens / total_s,
        "tg_tokens_per_s": median_of("tg_tokens_per_s"),
        "pp_tokens_per_s": None if pp_s is None else batch * prompt_tokens / pp_s,
        "pp_tokens": prompt_tokens if pp_s is not None else None,
        "total_s": total_s,
        "total_ms_per_token": 1e3 * total_s / new_tokens,  # for JAX: the compiled loop's steady state
        "per_step_ms": np.median(curves, axis=0).tolist() if curves else [],  # [N]
    }


def tg_tokens_per_s(step_ms: Sequence[float], batch: int) -> float | None:
    """Generated tokens per second over decode steps 1..N-1 (step 0 holds the prefill)."""
    decode_s = float(np.sum(step_ms[1:])) / 1e3
    return batch * (len(step_ms) - 1) / decode_s if len(step_ms) > 1 and decode_s > 0 else None


def measure_row(
    runner: Runner,
    module: Timed,
    model: Any,
    call: RowCall,
    prompts: np.ndarray,
    args: argparse.Namespace,
    sweep: list[int],
    tick: Callable[[str], None],
    pp_prompts: np.ndarray | None = None,
) -> dict[str, Any]:
    """Warm-up, then --repeats timed whole generations and streamed ones (and, given pp_prompts [B, P'],
    a prefill of them: one new token); medians, every repeat, the sweep."""
    new_tokens = args.new_tokens
    label = f"{runner.label} {call.mode}"
    speculative = call.mode == "speculative"
    if speculative:
        pp_prompts = None  # the same prefill as cached

    def figures(step_ms: list[float]) -> dict[str, float | None]:
        return speculative_step_figures(step_ms, not runner.compiles) if speculative else step_figures(step_ms)

    _, first_call_s = time_generate(module, model, prompts, new_tokens, call)  # warm-up 1; JAX compiles here
    tick(f"{label} warm-up")
    for _ in range(args.warmup - 1):
        time_generate(module, model, prompts, new_tokens, call)
        tick(f"{label} warm-up")
    for _ in range(args.warmup):
        time_stream(module, model, prompts, new_tokens, call)
        if pp_prompts is not None:
            time_generate(module, model, pp_prompts, 1, call)  # JAX compiles the long prompt's programs here
        tick(f"{label} warm-up")
    repeats: list[dict[str, Any]] = []
    tokens = None
    for index in range(args.repeats):
        tokens, total_s = time_generate(module, model, prompts, new_tokens, call)
        stream_tokens, step_ms = time_stream(module, model, prompts, new_tokens, call)
        repeats.append(
            {
                "total_s": total_s,
                **figures(step_ms),
                "tg_tokens_per_s": None if speculative else tg_tokens_per_s(step_ms, prompts.shape[0]),
                "pp_s": None if pp_prompts is None else time_generate(module, model, pp_prompts, 1, call)[1],
                "per_step_ms": [] if speculative and runner.compiles else step_ms,
                "stream_tokens_equal": bool(np.array_equal(stream_tokens, tokens)),
            }
        )
        tick(f"{label} {index + 1}/{args.repeats}")
    pp_tokens = 0 if pp_prompts is None else pp_prompts.shape[1]
    row = {
        **summarize(repeats, prompts.shape[0], new_tokens, pp_tokens),
        "first_call_s": first_call_s,
        "repeats": repeats,
        "tokens": tokens,
    }
    row["compile_s"] = max(0.0, first_call_s - row["total_s"]) if runner.compiles else None
    total_s = row["total_s"]
    if speculative:
        assert call.speculative is not None  # set by every speculative call
        row["speculative"] = call.speculative
    if sweep:
        sweep_s = []
        for n in sweep:
            if n == new_tokens:  # measured above, the same way
                sweep_s.append(total_s)
            else:
                for _ in range(args.warmup):
                    time_generate(module, model, prompts, n, call)  # a new n is a new compile for JAX
                sweep_s.append(median([time_generate(module, model, prompts, n, call)[1] for _ in range(args.repeats)]))
            tick(f"{label} sweep {n}")
        row["sweep"] = {"new_tokens": list(sweep), "total_s": sweep_s, "slope": fit_slope(sweep, sweep_s)}
    else:
        row["sweep"] = None
    return row


def matvec_bandwidth(seconds: Sequence[float]) -> float:
    """Bytes per second of the matrix a matrix-vector product streams (the vectors are negligible)."""
    rows, cols = MATVEC_SHAPE
    return rows * cols * 4 / median(seconds)


# A peer's weight format as the port format that streams the same bytes (llama.cpp's F16 cache: 2 bytes).
PEER_FORMATS = {
    "Q4_0": ("bfloat16", "q4"),
    "Q4_1": ("bfloat16", "q4"),
    "F16": ("bfloat16", "none"),
    "F32": ("float32", "none"),
    "int8": ("float32", "int8"),
}
INT8_SCALE_BYTES = 4  # int8: one float32 scale per output row
Q4_BLOCK_BYTES = 20 / 32  # q4 as GGUF's Q4_1 stores it: 16 bytes of nibbles, a float16 scale and min per 32


def matrix_bytes(array: np.ndarray, quant: str, four_bit: bool, itemsize: int) -> float:
    """The bytes a decode step streams of one weight matrix [out, in] in format `quant`: float at
    itemsize; int8 a byte a weight and a scale per output row; q4 Q4_1's 20 bytes per 32 weights for
    a matrix the file holds in 4 bits (the others go the int8 way, as the ports load them)."""
    if quant == "none" or array.ndim != 2:
        return float(array.size * itemsize)  # vectors (norms, biases) stay at the compute dtype
    if quant == "q4" and four_bit:
        return array.size * Q4_BLOCK_BYTES
    return float(array.size + array.shape[0] * INT8_SCALE_BYTES)


def format_of(weights: str) -> tuple[str, str]:
    """A row's `weights` (a port's `bfloat16+int8`, a peer's `Q4_1`) as the (dtype, quant) whose bytes it streams."""
    if weights in PEER_FORMATS:
        return PEER_FORMATS[weights]
    dtype, _, quant = weights.partition("+")
    return dtype, quant or "none"


def decode_bytes(
    config: ModelConfig,
    tensors: dict[str, np.ndarray],
    batch: int,
    prompt_len: int,
    new_tokens: int,
    itemsize: int,
    quant: str = "none",
    four_bit: frozenset[str] = frozenset(),
) -> float:
    """Bytes one decode step must read at the least, averaged over steps 1..N-1: every weight
    once in its format (`matrix_bytes`; `four_bit`: the matrices a q4 row holds in 4 bits; the
    embedding tables only for their looked-up rows, at itemsize; a tied head reads `emb` whole, in
    the format), plus the keys and values of every earlier position at itemsize."""
    gathered = {"emb.weight", "pos.weight"} - (set() if not config.tie_embeddings else {"emb.weight"})
    weights = sum(
        matrix_bytes(array, quant, name in four_bit, itemsize)
        for name, array in tensors.items()
        if name not in gathered
    )
    weights += batch * config.d_model * itemsize * len(gathered & set(tensors))  # the rows looked up
    if config.tie_embeddings and quant != "none" and "emb.weight" in tensors:
        weights += batch * config.d_model * itemsize  # the lookup reads a float row beside the quantized head
    positions = np.arange(prompt_len + 1, prompt_len + new_tokens)  # context length at decode steps 1..N-1
    per_position = kv_cache_bytes(config, batch, 1, itemsize)  # k and v of one position, every layer
    return float(weights + per_position * positions.mean())


def load_average() -> float | None:
    """The 1-minute load average: other work on the machine shows up in every timing."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def threads_info(peers: bool = False) -> dict[str, Any]:
    info: dict[str, Any] = {"cpu_count": os.cpu_count()}
    if hasattr(os, "sched_getaffinity"):
        info["usable_cpus"] = len(os.sched_getaffinity(0))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "XLA_FLAGS"):
        if name in os.environ:
            info[name] = os.environ[name]
    if "torch" in sys.modules:  # only if a row loaded it: the bench itself stays NumPy-only
        info["torch"] = sys.modules["torch"].get_num_threads()
    if peers:
        info["peers"] = peer_threads()
    return info


def peer_threads() -> int:
    """The threads a peer engine is given (llama.cpp's n_threads, CTranslate2's intra_threads): the ports'
    own count, OMP_NUM_THREADS when it is set, else every CPU this process may use."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    if "torch" in sys.modules:
        return int(sys.modules["torch"].get_num_threads())
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
