"""What the command line, the tests and the benchmark call: NumPy in, NumPy out.
The same names in every port (the contract: docs/PORTS.md); only the framework calls differ."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvports.shared.capabilities import refusal
from kvports.shared.checks import check_chunk_sizes
from kvports.shared.config import ModelConfig
from kvports.shared.generation import GenerationConfig, RowSampling, as_generation, step_logprobs
from kvports.shared.quantization import float_tensors
from kvports.shared.shapes import ALIGNMENT
from kvports.torch_impl import bandwidth, paged, speculative
from kvports.torch_impl.fast import onednn
from kvports.torch_impl.fast.onednn import use_onednn
from kvports.torch_impl.fast.quant import quantize_model
from kvports.torch_impl.fast.row_loop import use_loop_layers
from kvports.torch_impl.generate import generate_cached, generate_naive, prefill
from kvports.torch_impl.model import TinyModel, init_cache
from kvports.torch_impl.paged import init_block_pool as init_block_pool  # the contract's, as paged.py makes it

NAME = "torch"
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def versions() -> dict[str, str]:
    return {"torch": torch.__version__}


def resolve_device(device: str) -> torch.device:
    if device == "gpu":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise RuntimeError(f"torch {torch.__version__} ({build}) finds no GPU")
        # float32 must mean float32 on a GPU: IEEE float32 matmuls, never TF32: torch 2.9's switches, or
        # before them (a machine's own CUDA build) the two they replaced.
        if hasattr(torch.backends.cudnn, "conv"):
            torch.backends.cuda.matmul.fp32_precision = "ieee"
            torch.backends.cudnn.conv.fp32_precision = "ieee"
        else:
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        return torch.device("cuda")
    return torch.device("cpu")


def device_count(device: str) -> int | None:
    """The devices a model can be split across: the GPUs, one rank each; None on the CPU (no bound:
    one process per shard)."""
    return int(torch.cuda.device_count()) if device == "gpu" else None


def _on_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    # The model makes its cache, positions and masks with factory calls on the default
    # device; on a GPU this context puts them beside the weights. It costs Python time on
    # every op, so the CPU goes without.
    return device if device.type != "cpu" else contextlib.nullcontext()


def as_host(logits: torch.Tensor) -> np.ndarray:
    """Logits as NumPy: bfloat16's as float32 (NumPy has no bfloat16), float64's as they are."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32)).cpu().numpy()


def shapes_only(config: ModelConfig) -> TinyModel:
    """The model with its parameters' shapes and dtypes but no values (on the meta device): every
    tensor is set from the file. torch.nn.init's draws are no-ops meanwhile: they would fill nothing
    there, and a draw on a meta tensor imports torch's compiler (torch._dynamo), about 2 s of a load."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_")
    saved = {name: getattr(torch.nn.init, name) for name in names}
    for name in names:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        with torch.device("meta"):
            return TinyModel(config)
    finally:
        for name, draw in saved.items():
            setattr(torch.nn.init, name, draw)


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """The loader's array as a tensor: its own memory where that is writable and 64-byte aligned (a
    fresh array, or the load cache's private copy-on-write map), else a copy into torch's allocator,
    which aligns it."""
    if array.flags.writeable and array.ctypes.data % ALIGNMENT == 0:
        return torch.from_numpy(array)
    return torch.tensor(array)


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
    assert refusal("torch", dtype, quant, tensor_parallel) is None, refusal("torch", dtype, quant, tensor_parallel)
    if tensor_parallel > 1:
        from kvports.torch_impl.fast.parallel import PortCalls, load_parallel

        calls = PortCalls(load_model, generate, generate_speculative, forward_chunks)  # what each rank runs
        return load_parallel(config, tensors, dtype, device, tensor_parallel, calls)
    config = config.for_compute()  # a window wider than max_seq_len, narrowed: JAX's int32 masks stay exact
    model = shapes_only(config)  # every tensor is set from the file below
    state = {name: as_tensor(array) for name, array in float_tensors(tensors).items()}
    model.load_state_dict(state, strict=True, assign=True)
    if quant != "none":
        model = quantize_model(model, tensors, quant)  # the Linear layers swapped (fast/quant.py)
    model = model.to(device=resolve_device(device), dtype=TORCH_DTYPES[dtype]).eval()
    # Every linear through the CPU's fastest route at batch 1, float32 weights laid out [in, out] (fast/onednn.py)
    model = use_onednn(model)
    # At --threads, each float32 norm and a decode step's attention as one C++ call (fast/row_loop.py)
    return use_loop_layers(model)


def linear_route(dtype: str, quant: str, device: str) -> str:
    return onednn.linear_route(dtype, quant, device)  # what use_onednn and fast/quant.py chose for this CPU


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
    stops) and step logits [B, steps, V]; on_token(token [B]) as each token reaches the host.
    generation: a GenerationConfig, or a number of greedy tokens."""
    if not isinstance(model, TinyModel):  # a ParallelModel (fast/parallel.py): its ranks make this call
        return model.call("generate", prompts, generation, mode, return_logits, prefill, on_token=on_token)
    device = model.emb.weight.device
    prompt = torch.from_numpy(np.asarray(prompts, dtype=np.int64)).to(device)  # [B, P]
    to_host = None if on_token is None else (lambda token: on_token(token.cpu().numpy()))
    with _on_device(device):
        if mode == "cached":
            tokens, logits = generate_cached(model, prompt, as_generation(generation), return_logits, prefill, to_host)
        else:
            tokens, logits = generate_naive(model, prompt, as_generation(generation), return_logits, to_host)
    # [B, P + N], [B, steps, V]: bfloat16 logits as float32 (NumPy has no bfloat16)
    return tokens.cpu().numpy(), None if logits is None else as_host(logits)


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
    if not isinstance(model, TinyModel):  # a ParallelModel (fast/parallel.py): its ranks make this call
        return model.call("generate_speculative", draft, prompts, generation, draft_tokens, ngram, on_token=on_token)
    device = model.emb.weight.device
    prompt = torch.from_numpy(np.asarray(prompts, dtype=np.int64)).to(device)  # [B, P]
    to_host = None if on_token is None else (lambda token: on_token(token.cpu().numpy()))
    with _on_device(device):
        tokens, counts = speculative.generate_speculative(
            model, draft, prompt, as_generation(generation), draft_tokens, ngram, to_host
        )
    return tokens.cpu().numpy(), counts  # [B, P + N]


def forward_chunks(model: TinyModel, tokens: np.ndarray, chunk_sizes: Sequence[int]) -> np.ndarray:
    """Feed tokens [B, T] into one cache in chunks of the given sizes; the logits [B, T, V]."""
    chunk_sizes = check_chunk_sizes(chunk_sizes, np.shape(tokens)[1])
    if not isinstance(model, TinyModel):  # a ParallelModel (fast/parallel.py): its ranks make this call
        return model.call("forward_chunks", tokens, chunk_sizes)
    device = model.emb.weight.device
    tokens = torch.from_numpy(np.asarray(tokens, dtype=np.int64)).to(device)  # [B, T]
    pieces, start = [], 0
    with torch.inference_mode(), _on_device(device):
        model.eval()
        cache = init_cache(model.config, tokens.shape[0], tokens.shape[1], model.emb.weight.dtype)
        for size in chunk_sizes:
            logits, cache = prefill(model, tokens[:, start : start + size], cache)  # [B, size, V]
            pieces.append(logits)
            start += size
    return as_host(torch.cat(pieces, dim=1))  # [B, T, V]: bfloat16 as float32


def synchronize(model: TinyModel) -> None:
    # A ParallelModel's calls return once its ranks are done: nothing is left to wait for.
    if isinstance(model, TinyModel) and model.emb.weight.device.type == "cuda":
        torch.cuda.synchronize()


def matvec_seconds(rows: int, cols: int, repeats: int, device: str = "cpu") -> list[float]:
    """Seconds for each of `repeats` float32 products [rows, cols] @ [cols] (bandwidth.py)."""
    return bandwidth.matvec_seconds(rows, cols, repeats, resolve_device(device))


def init_weights(config: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """The reference initialisation: seed 0 with the default config is the seed's model."""
    torch.manual_seed(seed)
    model = TinyModel(config)
    return {name: tensor.detach().numpy().copy() for name, tensor in model.state_dict().items()}


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
    device = model.emb.weight.device

    def on_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(array)).to(device)

    with _on_device(device):
        next_tokens, pool, logits = paged.paged_step(
            model,
            pool,
            on_device(tokens),
            on_device(start),
            on_device(block_tables),
            on_device(sampling.temperature),
            on_device(sampling.top_k),
            on_device(sampling.top_p),
            on_device(sampling.uniform),
            None if sampling.allowed is None else on_device(sampling.allowed),
            return_logits=logprobs is not None,
            every_position=every_position,
        )
    next_tokens = next_tokens.cpu().numpy()  # [B]
    # float64 on the device first: NumPy has no bfloat16
    steps = (
        None
        if logits is None
        else step_logprobs(logits.double().cpu().numpy(), tokens, next_tokens, logprobs or 0, every_position)
    )
    return next_tokens, pool, steps  # [B], the pool, ([B], [B, K], [B, K]) ([B, T], [B, T, K] x 2) or None


def compile_paged_steps(
    model: TinyModel,
    pool: Any,
    max_step_tokens: int,
    longest: int,
    on_compiled: Callable[[int, int], None] | None = None,
) -> int:
    """Nothing to compile ahead: eager steps run at any shape (JAX's compiles each). 0 shapes."""
    return 0
