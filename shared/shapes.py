"""The model's tensors by name and shape: the state_dict every port's TinyModel holds (the
seed's names, Linear layers (out, in)), read from its config alone. The weights file, the
readers of other formats and the memory limits check and count against it."""

from __future__ import annotations

import math
from collections.abc import Iterator

from kvports.shared.config import ModelConfig


def layer_shapes(config: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Block i's tensors, in the seed's state_dict order."""
    D, Dh = config.d_model, config.head_dim
    gated = 2 if config.gated else 1
    shapes: dict[str, tuple[int, ...]] = {}
    for norm in ("ln1", "ln2"):
        shapes.update(norm_shapes(config, f"blocks.{i}.{norm}"))
    for name, n_out, n_in, bias in (
        ("qkv", config.qkv_dim, D, config.attn_bias or config.qkv_bias),
        ("proj", D, config.n_heads * Dh, config.attn_bias),
        ("ffn.0", gated * config.ffn_dim, D, config.ffn_bias),
        ("ffn.2", D, config.ffn_dim, config.ffn_bias),
    ):
        shapes[f"blocks.{i}.{name}.weight"] = (n_out, n_in)
        if bias:
            shapes[f"blocks.{i}.{name}.bias"] = (n_out,)
    if config.qk_norm:
        shapes.update({f"blocks.{i}.q_norm.weight": (Dh,), f"blocks.{i}.k_norm.weight": (Dh,)})
    if config.post_norms:
        for norm in ("ln1_post", "ln2_post"):
            shapes.update(norm_shapes(config, f"blocks.{i}.{norm}"))
    return shapes


def norm_shapes(config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}.weight": (config.d_model,)}
    if config.norm == "layernorm":
        shapes[f"{prefix}.bias"] = (config.d_model,)
    return shapes


def outer_shapes(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """The tensors before the blocks and after them."""
    D, V = config.d_model, config.vocab_size
    before: dict[str, tuple[int, ...]] = {"emb.weight": (V, D)}
    if config.positions == "learned":
        before["pos.weight"] = (config.max_seq_len, D)
    after = norm_shapes(config, "ln")
    if not config.tie_embeddings:
        after["head.weight"] = (V, D)
    return before, after


def iter_expected(config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor's name and shape in state_dict order, one at a time: a config's n_layers
    may be anything up to 2**30, and a file is checked against it without a list that long."""
    before, after = outer_shapes(config)
    yield from before.items()
    for i in range(config.n_layers):
        yield from layer_shapes(config, i).items()
    yield from after.items()


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, in the seed's state_dict order (for a config whose size
    is already bounded: by a file it was checked against, or by the run's byte limit)."""
    return dict(iter_expected(config))


ALIGNMENT = 64  # bytes: MKL's small matrix products run about twice as slow on memory not aligned so


def stored_transposed(shape: tuple[int, ...]) -> bool:
    """Whether a CPU port keeps matrix `shape` (out, in) in memory as its transpose [in, out]: at
    batch 1 the BLAS matrix-vector product (OpenBLAS under NumPy, MKL under torch) streams a matrix
    with at least as many outputs as inputs ~1.1-2x faster so (SmolLM2's qkv, gate/up and tied head),
    and one with more inputs than outputs (a down projection) ~1.05-1.1x faster as its (out, in) rows
    (tools/profile_numpy.py, tools/profile_decode.py). The ports' fast/ layouts and the load cache's
    file follow this one rule, so a cached model is used as it is mapped, without a copy."""
    return len(shape) == 2 and shape[0] >= shape[1]


def parameter_count(config: ModelConfig) -> int:
    """The model's numbers, counted without listing its tensors."""
    before, after = outer_shapes(config)
    outer = sum(math.prod(shape) for shape in (*before.values(), *after.values()))
    return outer + config.n_layers * sum(math.prod(shape) for shape in layer_shapes(config, 0).values())
