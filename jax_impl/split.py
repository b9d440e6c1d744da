"""A model as jit takes it: a static description and a flat list of arrays.

JAX only: jit over the model's split state, not the module, because flattening an nnx module
on every call costs more than a decode step. The split happens once per generation (once per
model for the batching engine's steps: split_once); the
graphdef and the state's tree structure are static (models of one config share them, and with
them every compiled program), the state's arrays a flat list that jit takes at C++ speed.
generate.py, speculative.py and paged.py jit their loops and steps over it.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
from flax import nnx


class Static:
    """The graphdef and tree structure as one static argument. jit hashes its static arguments
    at every call, and an nnx graphdef's hash costs ~0.3 ms, more than a decode step: this one
    is hashed once, and interned, so every later lookup is an identity check."""

    def __init__(self, graphdef: Any, treedef: Any):
        self.graphdef, self.treedef, self.hash = graphdef, treedef, hash((graphdef, treedef))

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, Static) and (self.graphdef, self.treedef) == (other.graphdef, other.treedef)
        )


_INTERNED: dict[Static, Static] = {}


def split_model(model: nnx.Module) -> tuple[Static, list[jax.Array]]:
    """The model's static half (interned: equal models share one) and its arrays."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    static = Static(graphdef, treedef)
    return _INTERNED.setdefault(static, static), leaves


# Each stepped model's split, for the model's life (paged.py): a batching engine steps one loaded
# model many times, and flattening SmolLM2's 30 layers with eval() took ~35 ms a step on a CPU,
# more than the step's own program. A loaded model's arrays never change after its load.
_STEPPED: weakref.WeakKeyDictionary[nnx.Module, tuple[Static, list[jax.Array]]] = weakref.WeakKeyDictionary()


def split_once(model: nnx.Module) -> tuple[Static, list[jax.Array]]:
    """split_model of a model in eval mode (set here, the first time), kept for the model's life."""
    if model not in _STEPPED:
        model.eval()  # pitfall 3: dropout off
        _STEPPED[model] = split_model(model)
    return _STEPPED[model]


def merge_model(static: Static, leaves: list[jax.Array]) -> Any:
    """split_model's inverse, inside a jitted function: the module over the traced arrays."""
    return nnx.merge(static.graphdef, jax.tree.unflatten(static.treedef, leaves))
