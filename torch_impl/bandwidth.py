"""The bench's bandwidth probe in PyTorch: how fast this machine streams a matrix through the
product a decode step is made of. A batch-1 step reads every weight once, so the time it
cannot beat is the weights' bytes over this bandwidth (the roofline, kvports/bench).
Read it beside jax_impl/bandwidth.py and numpy_impl/bandwidth.py."""

from __future__ import annotations

import time

import torch

from kvports.torch_impl.fast import onednn


def matvec_seconds(rows: int, cols: int, repeats: int, target: torch.device) -> list[float]:
    """Seconds for each of `repeats` float32 products [rows, cols] @ [cols] on `target` (port.py's
    resolve_device), after one untimed call: the matrix's bytes over this time is the streaming
    bandwidth a roofline divides by."""
    matrix = torch.ones((rows, cols), dtype=torch.float32, device=target)  # [rows, cols]
    if target.type == "cpu":
        matrix = matrix.t().contiguous().t()  # laid out [cols, rows], as load_model lays out the model's weights
    vector = torch.ones(cols, dtype=torch.float32, device=target)  # [cols]
    seconds = []
    for _ in range(repeats + 1):
        if target.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            onednn.linear(vector[None], matrix)  # [1, rows]: the model's own path (MKL on the CPU)
        if target.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds[1:]
