"""The bench's bandwidth probe in NumPy: how fast this machine streams a matrix through the
product a decode step is made of. A batch-1 step reads every weight once, so the time it
cannot beat is the weights' bytes over this bandwidth (the roofline, kvports/bench).
Read it beside torch_impl/bandwidth.py."""

from __future__ import annotations

import time

import numpy as np


def matvec_seconds(rows: int, cols: int, repeats: int, target: str) -> list[float]:
    """Seconds for each of `repeats` float32 products [rows, cols] @ [cols] on `target` (port.py's
    resolve_device: the CPU), after one untimed call (page faults, thread start-up): the matrix's
    bytes over this time is the streaming bandwidth a roofline divides by."""
    matrix = np.ones((rows, cols), dtype=np.float32)  # [rows, cols]
    vector = np.ones(cols, dtype=np.float32)  # [cols]
    seconds = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        matrix @ vector  # [rows]
        seconds.append(time.perf_counter() - start)
    return seconds[1:]
