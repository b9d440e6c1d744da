"""What the command line, the tests and the benchmark call: NumPy in, NumPy out.
The same five names in every port; only the framework calls differ."""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import flax
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from flax import nnx
from jax import lax

from kvports.shared.config import ModelConfig
from kvports.jax_impl.model import TinyModel, decode_step, generate_cached, generate_naive, greedy, init_cache
from kvports.jax_impl.model import prefill as prefill_step

NAME = "jax"
JAX_DTYPES = {"float32": jnp.float32, "float64": jnp.float64}


def versions() -> Dict[str, str]:
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__}


def resolve_device(device: str) -> jax.Device:
    # model.py already pins float32 matmuls to "highest" precision: no TF32 on a GPU.
    if device == "gpu":
        try:
            return jax.devices("gpu")[0]
        except RuntimeError:
            raise RuntimeError("no GPU visible to JAX") from None
    return jax.devices("cpu")[0]


def _parameter_slots(model: TinyModel) -> Dict[str, Tuple[nnx.Variable, bool]]:
    """Every torch state_dict name -> (the nnx parameter it fills, transpose?).
    nnx.Linear keeps its kernel (in, out), the transpose of torch's (out, in) weight;
    nnx.LayerNorm calls its weight `scale`."""
    config = model.config
    slots: Dict[str, Tuple[nnx.Variable, bool]] = {"emb.weight": (model.emb.embedding, False)}
    if config.positions == "learned":
        slots["pos.weight"] = (model.pos.embedding, False)

    def norm(prefix: str, module: nnx.Module) -> None:
        if config.norm == "layernorm":
            slots[f"{prefix}.weight"] = (module.scale, False)
            slots[f"{prefix}.bias"] = (module.bias, False)
        else:
            slots[f"{prefix}.weight"] = (module.weight, False)

    def linear(prefix: str, module: nnx.Linear) -> None:
        slots[f"{prefix}.weight"] = (module.kernel, True)
        if module.bias is not None:
            slots[f"{prefix}.bias"] = (module.bias, False)

    for i, block in enumerate(model.blocks):
        norm(f"blocks.{i}.ln1", block.ln1)
        norm(f"blocks.{i}.ln2", block.ln2)
        linear(f"blocks.{i}.qkv", block.qkv)
        linear(f"blocks.{i}.proj", block.proj)
        linear(f"blocks.{i}.ffn.0", getattr(block.ffn, "0"))
        linear(f"blocks.{i}.ffn.2", getattr(block.ffn, "2"))
    norm("ln", model.ln)
    if not config.tie_embeddings:
        linear("head", model.head)
    return slots


def load_model(config: ModelConfig, tensors: Dict[str, np.ndarray], dtype: str = "float32", device: str = "cpu") -> TinyModel:
    target = resolve_device(device)
    with jax.default_device(target):
        model = TinyModel(config, dtype=JAX_DTYPES[dtype], rngs=nnx.Rngs(0))  # every parameter is overwritten below
    slots = _parameter_slots(model)
    assert set(slots) == set(tensors), f"names differ: {sorted(set(slots) ^ set(tensors))}"
    for name, (variable, transpose) in slots.items():
        array = tensors[name].T if transpose else tensors[name]
        assert tuple(variable.shape) == array.shape, f"{name}: file {array.shape}, model {tuple(variable.shape)}"
        variable.set_value(jax.device_put(np.ascontiguousarray(array, dtype=np.dtype(dtype)), target))
    n_params = len(jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n_params == len(slots), f"model has {n_params} parameters, the file fills {len(slots)}"
    model.eval()  # nnx's eval() sets dropout off in place and returns None
    return model


def _model_device(model: TinyModel) -> jax.Device:
    return next(iter(model.emb.embedding[...].devices()))


def generate(model: TinyModel, prompts: np.ndarray, new_tokens: int, mode: str,
             return_logits: bool = False, prefill: bool = True) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    prompt = jax.device_put(np.asarray(prompts, dtype=np.int32), _model_device(model))  # [B, P]
    # Always the logits-returning program, so one compile serves both kinds of call;
    # the unused logits never leave the device.
    if mode == "cached":
        tokens, logits = generate_cached(model, prompt, int(new_tokens), return_logits=True, prefill=prefill)
    else:
        tokens, logits = generate_naive(model, prompt, int(new_tokens), return_logits=True)
    return np.asarray(tokens, dtype=np.int64), np.asarray(logits) if return_logits else None  # [B, P + N], [B, N, V]


def forward_chunks(model: TinyModel, tokens: np.ndarray, chunk_sizes: Sequence[int]) -> np.ndarray:
    """Feed tokens [B, T] into one cache in chunks of the given sizes; the logits [B, T, V]."""
    tokens = jax.device_put(np.asarray(tokens, dtype=np.int32), _model_device(model))  # [B, T]
    with jax.default_device(_model_device(model)):
        cache = init_cache(model.config, tokens.shape[0], tokens.shape[1], model.emb.embedding.dtype)
    pieces, start = [], 0
    for size in chunk_sizes:
        logits, cache = prefill_step(model, tokens[:, start : start + size], cache)  # [B, size, V]
        pieces.append(np.asarray(logits))
        start += size
    return np.concatenate(pieces, axis=1)  # [B, T, V]


def forward_calls(model: TinyModel) -> int:
    return model.forward_calls


def clear_compiled() -> None:
    """Forget every compiled program, so the next call traces again (tests that patch a helper)."""
    jax.clear_caches()


def synchronize(model: TinyModel) -> None:
    # JAX dispatches asynchronously and has no device-wide barrier: wait on every live array
    # on the model's platform, which includes the outputs of anything still running.
    jax.block_until_ready(jax.live_arrays(_model_device(model).platform))


@jax.jit
def _next_token(logits: jax.Array) -> jax.Array:
    return greedy(logits[:, -1])[:, None]  # [B, T, V] -> [B, 1]


@jax.jit
def _naive_next_token(model: TinyModel, tokens: jax.Array, last: jax.Array) -> jax.Array:
    model.eval()  # inside jit: the traced copy
    logits, _ = model(tokens)  # [B, T, V]
    return greedy(lax.dynamic_index_in_dim(logits, last, axis=1, keepdims=False))[:, None]  # [B, 1]


def generate_stream(model: TinyModel, prompts: np.ndarray, new_tokens: int, mode: str,
                    on_token: Callable[[np.ndarray], None]) -> np.ndarray:
    """generate(), calling on_token(token [B]) as each new token reaches the host, so the
    benchmark can time every step; the first call comes after the prefill.
    One compiled call per step instead of generate's single compiled loop. Naive steps run
    over the history padded to the next power of two: a compile per length bucket, not per
    length, and a cost that still grows with the history (causal masking keeps the padding
    out of the real positions)."""
    device = _model_device(model)
    prompt = np.asarray(prompts, dtype=np.int32)  # [B, P]
    B, P = prompt.shape
    tokens = np.zeros((B, P + new_tokens), dtype=np.int32)  # [B, P + N], on the host: each token is streamed
    tokens[:, :P] = prompt
    if mode == "cached":
        with jax.default_device(device):
            cache = init_cache(model.config, B, P + new_tokens, model.emb.embedding.dtype)
        logits, cache = prefill_step(model, jax.device_put(prompt, device), cache)  # [B, P, V]
    for step in range(new_tokens):
        if mode == "cached":
            if step > 0:
                logits, cache = decode_step(model, token, cache)  # [B, 1, V]
            token = _next_token(logits)  # [B, 1]
        else:
            length = P + step
            bucket = min(P + new_tokens, 1 << (length - 1).bit_length())
            token = _naive_next_token(model, jax.device_put(tokens[:, :bucket], device), length - 1)  # [B, 1]
        tokens[:, P + step] = np.asarray(token)[:, 0]
        on_token(tokens[:, P + step].astype(np.int64))  # [B]
    return tokens.astype(np.int64)  # [B, P + N]


def matvec_seconds(rows: int, cols: int, repeats: int, device: str = "cpu") -> List[float]:
    """Seconds for each of `repeats` float32 products [rows, cols] @ [cols], after one untimed
    call (which also compiles): the matrix's bytes over this time is the streaming bandwidth
    a roofline divides by."""
    target = resolve_device(device)
    with jax.default_device(target):
        matrix = jnp.ones((rows, cols), dtype=jnp.float32)  # [rows, cols]
        vector = jnp.ones(cols, dtype=jnp.float32)  # [cols]
    product = jax.jit(jnp.matmul)
    seconds = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        product(matrix, vector).block_until_ready()  # [rows]
        seconds.append(time.perf_counter() - start)
    return seconds[1:]
