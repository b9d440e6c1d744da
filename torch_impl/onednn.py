"""oneDNN's linear for large float32 CPU weights: F.linear and nn.Linear otherwise.

Torch only: a matrix-vector product through a weight too big for the caches (GPT-2 small's
every matrix) streams it from memory. F.linear sends it to MKL's sgemm, which runs it on one
thread (~13 GB/s on the 2-core machine); oneDNN's linear, the op torch.compile emits for a CPU
linear, runs it on every core (~22-30 GB/s, NumPy's figure). Small weights stay with F.linear,
whose call costs less (~7 us against ~20-35 us).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_onednn_linear = torch.ops.mkldnn._linear_pointwise if ONEDNN else None
STREAMED = 1 << 18  # weight elements (1 MiB in float32) from which oneDNN measured faster, 1 to 1024 rows


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear: x [..., in], weight [out, in] -> [..., out]."""
    # Not under torch.compile: inductor lowers F.linear itself (and cannot lower this op unfrozen).
    streamed = weight.numel() >= STREAMED and x.is_cpu and x.dtype == torch.float32
    if _onednn_linear is not None and streamed and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return _onednn_linear(x, weight, bias, "none", [], "")  # [..., out]: no fused activation
    return F.linear(x, weight, bias)  # [..., out]


class Linear(nn.Linear):
    """nn.Linear (the same parameters, names and initialisation), through linear() above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
