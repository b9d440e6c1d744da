"""The bench's bandwidth probe in JAX: how fast this machine streams a matrix through the
product a decode step is made of. A batch-1 step reads every weight once, so the time it
cannot beat is the weights' bytes over this bandwidth (the roofline, kvports/bench).
Read it beside torch_impl/bandwidth.py."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def matvec_seconds(rows: int, cols: int, repeats: int, target: jax.Device) -> list[float]:
    """Seconds for each of `repeats` float32 products [rows, cols] @ [cols] on `target` (port.py's
    resolve_device), after one untimed call (which also compiles): the matrix's bytes over this
    time is the streaming bandwidth a roofline divides by."""
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
