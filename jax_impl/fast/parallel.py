"""Tensor parallelism in JAX: one model split across N devices, Megatron-style, by GSPMD.

Each parameter is placed on a one-axis `Mesh` with a `NamedSharding`, and the compiled loops in
generate.py run under `jit` unchanged: XLA propagates the shardings and inserts the one collective
the layout needs, an all-reduce after each row-parallel product. jit rather than `shard_map`:
the model keeps its global shapes and its one code path, where shard_map would need per-device
head counts and an explicit `psum` inside the model.

    qkv, ffn.0   column-parallel: split by output, whole heads (and the gate with its up) per device
    proj, ffn.2  row-parallel: split by input; the partial sums all-reduced, then the bias added once
    KV cache     split by key/value heads, as the k and v that fill it (XLA propagates it)
    emb, pos, norms, head  replicated: a device's head computes every logit, so sampling
                 (argmax, cumulative sums over the vocabulary) runs on the whole row, as with one device

The fused kernels are stored shard-major (device 0's q, k and v heads, then device 1's, ...;
for SwiGLU its gate and up slices), so each device's columns are one contiguous block. The model
reads its fused outputs in their natural order ([q | k | v], [gate | up]), so each such product
is swapped for a `ShardMajorLinear` (`regroup_fused`): the same kernel and bias, whose output is
put back in that order by reshapes, slices and one concatenate. XLA folds those slices of a
concatenate into slices of the product itself before it partitions the program, so each device
keeps reading its own block: 2 all-reduces a layer and no other collective (tests/
test_tensor_parallel.py counts them in the compiled program). A kernel stored in the natural
order and split in N blocks instead would hand devices other devices' heads: a collective-permute
for each of q, k and v. When N exceeds the key/value heads, each is copied to the devices whose
query heads read it (vLLM's rule), so the model runs with N key/value heads.

The float64 results equal one device's in every token; the logits differ in the last bits,
since an all-reduce adds the partial sums in another order than one product does.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvports.shared.checks import kv_layout
from kvports.shared.config import ModelConfig

AXIS = "model"  # the mesh's one axis: the devices a model is split across

# nnx's layout (a kernel is (in, out)) -> how each parameter is split; the rest is replicated.
SPECS = {
    r"blocks\.\d+\.(qkv|ffn\.0)\.weight": P(None, AXIS),  # column-parallel
    r"blocks\.\d+\.(qkv|ffn\.0)\.bias": P(AXIS),
    r"blocks\.\d+\.(proj|ffn\.2)\.weight": P(AXIS, None),  # row-parallel: the bias is added after the sum
}


def make_mesh(platform: str, tensor_parallel: int) -> Mesh:
    # Auto axes: XLA propagates the shardings and chooses the collectives (Explicit axes would
    # ask every contraction over a split axis to name its output's sharding).
    devices = jax.devices(platform)[:tensor_parallel]
    return jax.make_mesh((tensor_parallel,), (AXIS,), axis_types=(AxisType.Auto,), devices=devices)


def partition_spec(name: str) -> P:
    """A parameter's split, by its torch state_dict name, in nnx's layout."""
    return next((spec for pattern, spec in SPECS.items() if re.fullmatch(pattern, name)), P())


def split_model(
    config: ModelConfig, tensors: dict[str, np.ndarray], platform: str, tensor_parallel: int
) -> tuple[ModelConfig, dict[str, np.ndarray], Callable[[str], NamedSharding]]:
    """The config and tensors the split model runs (key/value heads copied where N exceeds them,
    the fused kernels shard-major), and each parameter's sharding by name."""
    mesh = make_mesh(platform, tensor_parallel)
    if kv_layout(config, tensor_parallel) == "replicate":
        tensors = replicate_kv_heads(config, tensors, tensor_parallel)
        config = dataclasses.replace(config, n_kv_heads=tensor_parallel)
    tensors = dict(tensors)
    for name in list(tensors):
        if re.fullmatch(r"blocks\.\d+\.qkv\.(weight|bias)", name):
            tensors[name] = shard_major(tensors[name], qkv_groups(config), tensor_parallel)
        elif re.fullmatch(r"blocks\.\d+\.ffn\.0\.(weight|bias)", name) and config.gated:
            tensors[name] = shard_major(tensors[name], [config.ffn_dim] * 2, tensor_parallel)
    return config, tensors, lambda name: NamedSharding(mesh, partition_spec(name))


def qkv_groups(config: ModelConfig) -> list[int]:
    Dh = config.head_dim
    return [config.n_heads * Dh, config.kv_heads * Dh, config.kv_heads * Dh]  # q, k, v


def shard_major(weight: np.ndarray, groups: list[int], tensor_parallel: int) -> np.ndarray:
    """A fused weight [sum(groups), ...] (torch's (out, in)) with its rows reordered so that each
    device's slice of every group comes together: [q_0 k_0 v_0 q_1 k_1 v_1 ...]."""
    pieces = np.split(weight, np.cumsum(groups)[:-1], axis=0)  # each group [width, ...]
    slices = [np.split(piece, tensor_parallel, axis=0) for piece in pieces]  # [group][device]
    return np.concatenate([slices[g][d] for d in range(tensor_parallel) for g in range(len(groups))], axis=0)


class ShardMajorLinear(nnx.Module):
    """x [..., in] -> [..., out] through a fused product whose kernel [in, out] is stored shard-major,
    the output in the natural order of its groups ([q | k | v], [gate | up]) that the model splits."""

    def __init__(self, linear: nnx.Linear, groups: Sequence[int], tensor_parallel: int):
        self.kernel, self.bias = linear.kernel, linear.bias  # the same parameters, under the names SPECS match
        self.groups, self.tensor_parallel = tuple(groups), tensor_parallel

    def __call__(self, x: jax.Array) -> jax.Array:
        out = x @ self.kernel[...]  # [..., out]: device 0's columns of every group, then device 1's, ...
        if self.bias is not None:
            out = out + self.bias[...]
        by_device = out.reshape(*out.shape[:-1], self.tensor_parallel, -1)  # [..., N, out / N]
        widths = [width // self.tensor_parallel for width in self.groups]  # one device's columns of each group
        parts = jnp.split(by_device, np.cumsum(widths)[:-1], axis=-1)  # [..., N, width / N] each
        return jnp.concatenate([part.reshape(*out.shape[:-1], -1) for part in parts], axis=-1)  # [..., out]


def regroup_fused(model: nnx.Module, tensor_parallel: int) -> nnx.Module:
    """Each block's qkv (and SwiGLU's gate/up) a ShardMajorLinear over its own parameters: the kernels
    split_model stores shard-major read back in the order the model splits."""
    config = model.config
    for block in model.blocks:
        block.qkv = ShardMajorLinear(block.qkv, qkv_groups(config), tensor_parallel)
        if config.gated:
            gate_up = ShardMajorLinear(getattr(block.ffn, "0"), [config.ffn_dim] * 2, tensor_parallel)
            setattr(block.ffn, "0", gate_up)
    return model


def replicate_kv_heads(
    config: ModelConfig, tensors: dict[str, np.ndarray], tensor_parallel: int
) -> dict[str, np.ndarray]:
    """Each key/value head repeated N / Hkv times, in place, so that key/value head j serves query
    heads j * H / N onward: the same keys and values each query head read before."""
    H, Hkv, Dh = config.n_heads, config.kv_heads, config.head_dim
    copies = tensor_parallel // Hkv
    out = dict(tensors)
    for name, array in tensors.items():
        if re.fullmatch(r"blocks\.\d+\.qkv\.(weight|bias)", name):
            q, k, v = np.split(array, [H * Dh, (H + Hkv) * Dh], axis=0)  # [H Dh, ...], [Hkv Dh, ...] x 2

            def repeat(heads: np.ndarray) -> np.ndarray:
                per_head = heads.reshape(Hkv, Dh, *heads.shape[1:])  # [Hkv, Dh, ...]
                return np.repeat(per_head, copies, axis=0).reshape(tensor_parallel * Dh, *heads.shape[1:])

            out[name] = np.concatenate([q, repeat(k), repeat(v)], axis=0)  # [(H + 2N) Dh, ...]
    return out
