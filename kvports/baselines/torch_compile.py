"""The torch port with its model's forward under `torch.compile`: the optional compiled row.

The same model and the same decode loop; only the cache's length is a tensor (torch_impl/fast/compiled.py's
cache and `generate_compiled`), so every decode step has one shape and the attention one mask over all
slots: one graph for the prefill, one for every decode step, no recompile per position.
The first call compiles, so the bench reports its extra time as compile time, apart from
the steady state. On a GPU, `mode="reduce-overhead"` replays each step as a CUDA graph.

On the CPU the forward compiles as inductor's CPU experts set it up for inference (`CPU_INDUCTOR`):
`freezing` makes the weights constants of the graph, so that each linear can be packed once, and
`max_autotune` with the CPP backend times inductor's own C++ GEMM (AVX-512 micro-kernels, its
threads split over the output columns) against ATen's for every product shape and keeps the faster.
At one row, SmolLM2's products all went to the C++ GEMM: a float32 decode step took 18.5 ms against
eager's 33.7 at 1 thread and 15.6 against 31.9 at 2 (MKL's sgemv streams ~1.5x slower and does not
use a second thread). The price is the first call's compile (100-170 s for SmolLM2, every product
shape timed; inductor keeps the results on disk for the next process) and a packed copy of each
weight beside the model's own.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvports.shared.config import ModelConfig
from kvports.shared.generation import as_generation
from kvports.torch_impl import port as torch_port
from kvports.torch_impl.fast.compiled import generate_compiled
from kvports.torch_impl.model import TinyModel

NAME = "torch"
MODES = ("cached",)
CPU_INDUCTOR = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


def inductor_settings(on_gpu: bool) -> dict[str, object]:
    """The inductor configuration each compile of the row runs under: the CPU's above, the defaults on a GPU."""
    return {} if on_gpu else dict(CPU_INDUCTOR)


def versions() -> dict[str, str]:
    return torch_port.versions()


def load_model(
    config: ModelConfig,
    tensors: dict[str, np.ndarray],
    dtype: str = "float32",
    device: str = "cpu",
    quant: str = "none",
) -> TinyModel:
    # The port's own model at the row's format: a quantized one's Linear layers are fast/quant.py's, whose
    # packed kernels inductor lowers (with max-autotune, its own weight-only int8 GEMM beside ATen's).
    model = torch_port.load_model(config, tensors, dtype, device, quant=quant)
    # Dynamo keys its compiled code on the forward's code object, which every TinyModel shares: each model
    # the process compiled adds its graphs there, and past the recompile limit (8, two a model) a forward
    # runs eagerly, with no more than a logged warning. Each row's model starts from an empty cache.
    torch._dynamo.reset()
    # CUDA graphs need static shapes and a GPU; on the CPU the default mode fuses what it can.
    model.compile(mode="reduce-overhead" if model.emb.weight.is_cuda else None)
    return model


def generate(
    model: TinyModel,
    prompts: np.ndarray,
    new_tokens: int,
    mode: str = "cached",
    return_logits: bool = False,
    on_token: Callable[[np.ndarray], None] | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """The torch port's cached greedy generation, through the compiled forward."""
    if mode not in MODES:
        raise ValueError(f"the compiled row runs {MODES}, not {mode!r}")
    device = model.emb.weight.device
    prompt = torch.from_numpy(np.asarray(prompts, dtype=np.int64)).to(device)  # [B, P]
    to_host = None if on_token is None else (lambda token: on_token(token.cpu().numpy()))
    # Compiles happen at the first call of each new shape (the prompt's, a decode step's), so the
    # settings hold around every call, not around model.compile().
    from torch._inductor import config as inductor_config  # inductor's import is heavy: only when the row runs

    with inductor_config.patch(inductor_settings(model.emb.weight.is_cuda)):
        tokens, logits = generate_compiled(model, prompt, as_generation(new_tokens), return_logits, to_host)
    return tokens.cpu().numpy(), None if logits is None else logits.cpu().numpy()  # [B, P + N], [B, N, V]


synchronize = torch_port.synchronize
matvec_seconds = torch_port.matvec_seconds
