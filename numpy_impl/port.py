"""What the command line, the tests and the benchmark call: NumPy in, NumPy out.
The same names in every port (the contract: docs/PORTS.md); only the framework calls differ."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvports.numpy_impl import bandwidth, paged, speculative
from kvports.numpy_impl.fast.layout import lay_out
from kvports.numpy_impl.fast.row_loop import row_threads
from kvports.numpy_impl.generate import generate_cached, generate_naive, prefill
from kvports.numpy_impl.model import TinyModel, init_cache
from kvports.numpy_impl.paged import init_block_pool as init_block_pool  # the contract's, as paged.py makes it
from kvports.shared.capabilities import refusal
from kvports.shared.checks import check_chunk_sizes
from kvports.shared.config import ModelConfig
from kvports.shared.generation import GenerationConfig, RowSampling, as_generation, step_logprobs

NAME = "numpy"
NUMPY_DTYPES = {"float32": np.float32, "float64": np.float64}


def versions() -> dict[str, str]:
    return {"numpy": np.__version__}


def resolve_device(device: str) -> str:
    if device == "gpu":
        raise RuntimeError("numpy runs on the CPU only")
    return "cpu"


def device_count(device: str) -> int | None:
    """The devices a model can be split across: NumPy runs on one."""
    return 1


def load_model(
    config: ModelConfig,
    tensors: dict[str, np.ndarray],
    dtype: str = "float32",
    device: str = "cpu",
    *,
    quant: str = "none",
    tensor_parallel: int = 1,
) -> TinyModel:
    # What shared/capabilities.py says this port loads (the application's rules refused the rest first).
    assert refusal("numpy", dtype, quant, tensor_parallel) is None, refusal("numpy", dtype, quant, tensor_parallel)
    config = config.for_compute()  # a window wider than max_seq_len, narrowed: JAX's int32 masks stay exact
    resolve_device(device)
    model = TinyModel(config)  # placeholder weights: every tensor comes from the file
    model.load_state_dict(tensors)
    model = model.to(NUMPY_DTYPES[dtype]).eval()
    return lay_out(model)  # each matrix in the memory order OpenBLAS streams fastest at batch 1 (fast/layout.py)


def linear_route(dtype: str, quant: str, device: str) -> str:
    # np.matmul: the BLAS NumPy was built with picks its own kernel for the CPU; at --threads, a
    # float32 decode step's one-row products run numba's compiled loop where numba is installed
    return "numba+blas" if dtype == "float32" and row_threads() else "blas"


def generate(
    model: TinyModel,
    prompts: np.ndarray,
    generation: int | GenerationConfig,
    mode: str,
    return_logits: bool = False,
    prefill: bool = True,
    on_token: Callable[[np.ndarray], None] | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """prompts [B, P] (PAD on the left of shorter rows) -> tokens [B, P + N] (PAD after a row
    stops) and step logits [B, steps, V]; on_token(token [B]) as each token is made.
    generation: a GenerationConfig, or a number of greedy tokens."""
    prompt = np.asarray(prompts, dtype=np.int64)  # [B, P]
    to_host = None if on_token is None else (lambda token: on_token(token.copy()))  # a copy: the caller may keep it
    if mode == "cached":
        return generate_cached(model, prompt, as_generation(generation), return_logits, prefill, to_host)
    return generate_naive(model, prompt, as_generation(generation), return_logits, to_host)  # [B, P + N], [B, steps, V]


def generate_speculative(
    model: TinyModel,
    draft: TinyModel | None,
    prompts: np.ndarray,
    generation: int | GenerationConfig,
    draft_tokens: int,
    ngram: int = 2,
    on_token: Callable[[np.ndarray], None] | None = None,
) -> tuple[np.ndarray, dict[str, int]]:
    """The target's own tokens [B, P + N] from draft-and-verify rounds, and their counts. draft:
    a model loaded with load_model (same vocabulary), or None for prompt lookup of n-grams."""
    prompt = np.asarray(prompts, dtype=np.int64)  # [B, P]
    to_host = None if on_token is None else (lambda token: on_token(token.copy()))  # a copy: the caller may keep it
    return speculative.generate_speculative(
        model, draft, prompt, as_generation(generation), draft_tokens, ngram, to_host
    )


def forward_chunks(model: TinyModel, tokens: np.ndarray, chunk_sizes: Sequence[int]) -> np.ndarray:
    """Feed tokens [B, T] into one cache in chunks of the given sizes; the logits [B, T, V]."""
    chunk_sizes = check_chunk_sizes(chunk_sizes, np.shape(tokens)[1])
    tokens = np.asarray(tokens, dtype=np.int64)  # [B, T]
    pieces, start = [], 0
    model.eval()
    cache = init_cache(model.config, tokens.shape[0], tokens.shape[1], model.emb.weight.dtype)
    for size in chunk_sizes:
        logits, cache = prefill(model, tokens[:, start : start + size], cache)  # [B, size, V]
        pieces.append(logits)
        start += size
    return np.concatenate(pieces, axis=1)  # [B, T, V]


def synchronize(model: TinyModel) -> None:
    pass  # NumPy returns only when the work is done: nothing to wait for


def matvec_seconds(rows: int, cols: int, repeats: int, device: str = "cpu") -> list[float]:
    """Seconds for each of `repeats` float32 products [rows, cols] @ [cols] (bandwidth.py)."""
    return bandwidth.matvec_seconds(rows, cols, repeats, resolve_device(device))


def clear_compiled() -> None:
    """Nothing is compiled here; JAX's twin forgets its compiled programs."""


# ---------------------------------------------------------------- continuous batching
# What kvports/batching's engine calls: a pool of KV blocks shared by the running sequences
# (init_block_pool, from paged.py), and one step of the running batch over it (docs/BATCHING.md).


def paged_step(
    model: TinyModel,
    pool: Any,
    tokens: np.ndarray,
    start: np.ndarray,
    block_tables: np.ndarray,
    sampling: RowSampling,
    logprobs: int | None = None,
    every_position: bool = False,
) -> tuple[np.ndarray, Any, tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
    """One step of the running batch: tokens [B, T] (PAD on the left of shorter rows) after each row's
    `start` [B] tokens in the pool, block_tables [B, M] (-1 past a row's blocks), sampling: each
    row's temperature, top-k, top-p and draw [B]; logprobs: how many likeliest tokens to report, or
    None; every_position: each position's instead ([B, T], [B, T, K]: a prompt's own). The next
    token of every row [B] (PAD where its logits were not finite), the pool to pass
    to the next step (paged.py), and, when asked, the chosen tokens' log-probabilities [B]
    and the likeliest ids and their log-probabilities [B, K]."""
    next_tokens, pool, logits = paged.paged_step(
        model,
        pool,
        np.asarray(tokens),
        np.asarray(start),
        np.asarray(block_tables),
        np.asarray(sampling.temperature),
        np.asarray(sampling.top_k),
        np.asarray(sampling.top_p),
        np.asarray(sampling.uniform),
        None if sampling.allowed is None else np.asarray(sampling.allowed),
        return_logits=logprobs is not None,
        every_position=every_position,
    )
    steps = None if logits is None else step_logprobs(logits, tokens, next_tokens, logprobs or 0, every_position)
    return next_tokens, pool, steps  # [B], the pool, ([B], [B, K], [B, K]) or None


def compile_paged_steps(
    model: TinyModel,
    pool: Any,
    max_step_tokens: int,
    longest: int,
    on_compiled: Callable[[int, int], None] | None = None,
) -> int:
    """Nothing to compile ahead: eager steps run at any shape (JAX's compiles each). 0 shapes."""
    return 0
