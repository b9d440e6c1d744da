"""The few pieces of torch.nn this port needs, in NumPy: Module, Linear, LayerNorm,
Embedding, Dropout. model.py imports this as `nn`, so its lines read as the torch port's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

import numpy as np
from numpy.typing import DTypeLike

import kvports.numpy_impl.functional as F

M = TypeVar("M", bound="Module")


class Module:
    """The part of nn.Module this port needs: named parameters (so torch's state_dict
    names load as they are), a dtype cast, and the train/eval switch."""

    training = True  # as nn.Module: a fresh model is in train mode until eval()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no forward")  # as nn.Module: every module defines it

    def named_children(self) -> Iterator[tuple[str, Module]]:
        for name, value in vars(self).items():
            if isinstance(value, Module):
                yield name, value
            elif isinstance(value, list):  # a plain list stands in for nn.ModuleList
                for i, item in enumerate(value):
                    if isinstance(item, Module):
                        yield f"{name}.{i}", item

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Module, str]]:
        for name, value in vars(self).items():
            if isinstance(value, np.ndarray):
                yield prefix + name, self, name
        for name, child in self.named_children():
            yield from child.named_parameters(f"{prefix}{name}.")

    def load_state_dict(self: M, state: dict) -> M:
        # strict, as torch's load_state_dict(strict=True): no missing, unexpected or misshaped tensor.
        own = {name: (owner, attr) for name, owner, attr in self.named_parameters()}
        if set(own) != set(state):
            missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
            raise KeyError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
        for name, (owner, attr) in own.items():
            array = np.asarray(state[name])
            if array.shape != getattr(owner, attr).shape:
                raise ValueError(f"{name}: shape {array.shape}, expected {getattr(owner, attr).shape}")
            setattr(owner, attr, array)
        return self

    def to(self: M, dtype: DTypeLike) -> M:
        for _, owner, attr in self.named_parameters():
            # A copy only to another dtype: the loaders hand over arrays the model may own (fresh ones,
            # or a private copy-on-write map of the load cache, which a write never reaches).
            setattr(owner, attr, getattr(owner, attr).astype(dtype, copy=False))
        return self

    def train(self: M, mode: bool = True) -> M:
        self.training = mode
        for _, child in self.named_children():
            child.train(mode)
        return self

    def eval(self: M) -> M:
        return self.train(False)


class Linear(Module):
    # Placeholders until load_state_dict: NumPy has no meta device, and np.zeros costs no
    # memory until written.
    def __init__(self, n_in: int, n_out: int, bias: bool = True):
        self.weight = np.zeros((n_out, n_in), dtype=np.float32)  # (out, in), torch's layout
        self.bias = np.zeros((n_out,), dtype=np.float32) if bias else None

    def forward(self, x: np.ndarray) -> np.ndarray:
        return F.linear(x, self.weight, self.bias)  # [..., out]


class LayerNorm(Module):
    def __init__(self, dim: int, eps: float):
        self.eps = eps
        self.weight = np.ones((dim,), dtype=np.float32)
        self.bias = np.zeros((dim,), dtype=np.float32)

    def forward(self, x: np.ndarray) -> np.ndarray:
        # sum / D, not mean: ndarray.mean's Python bookkeeping costs more than a decode step's sums.
        centered = x - x.sum(-1, keepdims=True) / x.shape[-1]  # [B, T, D]
        var = np.square(centered).sum(-1, keepdims=True) / x.shape[-1]  # [B, T, 1], biased, as torch
        centered /= np.sqrt(var + self.eps)
        centered *= self.weight
        centered += self.bias
        return centered  # [B, T, D]


class Embedding(Module):
    def __init__(self, n: int, dim: int):
        self.weight = np.zeros((n, dim), dtype=np.float32)

    def forward(self, ids: np.ndarray) -> np.ndarray:
        return self.weight[ids]  # [B, T, D]


class Dropout(Module):
    # NumPy has no global seed like torch.manual_seed: the model's Generator is passed in.
    def __init__(self, p: float, rng: np.random.Generator):
        self.p, self.rng = p, rng

    def forward(self, x: np.ndarray) -> np.ndarray:
        if not self.training or self.p == 0.0:
            return x
        keep = self.rng.random(x.shape, dtype=x.dtype) >= self.p  # [B, T, D] bool
        return x * keep / (1.0 - self.p)  # [B, T, D]
