"""A model as jit takes it: a static description and a flat list of arrays.

JAX only: jit over the model's split state, not the module, because flattening an nnx module
on every call costs more than a decode step. The split happens once per generation; the
graphdef and the state's tree structure are static (models of one config share them, and with
them every compiled program), the state's arrays a flat list that jit takes at C++ speed.
generate.py, speculative.py and paged.py jit their loops and steps over it.
"""

from __future__ import annotations

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


def merge_model(static: Static, leaves: list[jax.Array]) -> Any:
    """split_model's inverse, inside a jitted function: the module over the traced arrays."""
    return nnx.merge(static.graphdef, jax.tree.unflatten(static.treedef, leaves))
