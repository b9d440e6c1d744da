"""Weight-only quantized Linear layers, swapped into a loaded model from outside (model.py stays float).

The CPU kernels gpt-fast and torchao use: `aten._weight_int8pack_mm` (int8 codes [out, in], one
float32 scale per output channel) and `aten._weight_int4pack_mm_for_cpu` (4-bit codes packed by
`_convert_weight_to_int4pack_for_cpu`, a scale and a zero per group of 32). Activations at the
model's dtype: the kernels are vectorised for bfloat16 only (about 10x float32's time at one row in
torch 2.13 on AVX-512), so --dtype bfloat16 is the fast path and float32 the exact one (scales and
zeros rounded to bfloat16 there, not here).

int4pack dequantizes a code q as (q - 8) * scale + zero. A GGUF Q4 block is scale * q + min
(Q4_0: min = -8 scale), so zero = min + 8 scale: Q4_1's (d, m) become (d, m + 8 d) and Q4_0's
zero is exactly 0, and the shipped 4-bit weights run without a second rounding.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from kvports.shared.quantization import Q4_GROUP, q4_blocks, quantize_int8
from kvports.torch_impl.fast import untie_head

INT4_ROWS = 16  # int4pack's CPU packing takes out_features in multiples of 16: others are padded


class Int8Linear(nn.Module):
    """x [..., in] -> [..., out] through int8 codes [out, in] and per-channel scales [out]."""

    def __init__(self, weight: np.ndarray, bias: torch.Tensor | None):
        super().__init__()
        codes, scales = quantize_int8(weight)
        self.register_buffer("codes", torch.from_numpy(codes))  # [out, in] int8
        self.register_buffer("scales", torch.from_numpy(scales))  # [out] float32
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [B * T, in]: the kernel takes a matrix
        if flat.dtype == torch.float32 and flat.shape[0] > 1:
            # The kernel's float32 path is not vectorised (0.59 ms a row for 576 -> 1536 here, 68 ms
            # for a 128-token prompt): several rows go through the weight dequantized once (2.5 ms).
            weight = self.codes.to(torch.float32) * self.scales[:, None]  # [out, in]
            out = flat @ weight.T  # [B * T, out]
        else:
            out = torch.ops.aten._weight_int8pack_mm(flat, self.codes, self.scales)  # [B * T, out]
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], out.shape[-1])  # [..., out]


class Int4Linear(nn.Module):
    """x [..., in] -> [..., out] through a GGUF file's own 4-bit codes, packed for the CPU kernel."""

    def __init__(self, codes: np.ndarray, scales: np.ndarray, mins: np.ndarray, bias: torch.Tensor | None):
        super().__init__()
        self.rows = codes.shape[0]
        pad = -self.rows % INT4_ROWS  # rows of zero weight (scale and zero 0), sliced off the product
        codes, scales, mins = (np.pad(array, ((0, pad), (0, 0))) for array in (codes, scales, mins))
        # [out', in / 2] uint8, in the kernel's own layout (innerKTiles is unused on the CPU)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(codes.astype(np.int32)), 1)
        zeros = mins + 8 * scales  # [out', in / 32]
        scales_and_zeros = np.stack([scales.T, zeros.T], axis=-1)  # [in / 32, out', 2]
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", torch.from_numpy(np.ascontiguousarray(scales_and_zeros)))
        # Two codes a byte in our own order, [out', in / 2]: the float32 route's (the kernel's layout is its own)
        nibbles = codes[:, 0::2].astype(np.uint8) | (codes[:, 1::2].astype(np.uint8) << 4)
        self.register_buffer("nibbles", torch.from_numpy(np.ascontiguousarray(nibbles)))
        self.bias = bias

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] at float32: (code - 8) * scale + zero, as the kernel reads it."""
        codes = torch.stack([self.nibbles & 15, self.nibbles >> 4], dim=-1)  # [out', in / 2, 2]
        rows = codes.shape[0]
        groups = codes.view(rows, -1, Q4_GROUP).to(torch.float32)  # [out', in / 32, 32]
        scales, zeros = self.scales_and_zeros.to(torch.float32).unbind(-1)  # [in / 32, out'] each
        weight = (groups - 8) * scales.T[..., None] + zeros.T[..., None]  # [out', in / 32, 32]
        return weight.view(rows, -1)[: self.rows]  # [out, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [B * T, in]
        if flat.dtype == torch.float32 and flat.shape[0] > 1:
            # The kernel's float32 path is not vectorised (197 ms for a 128-token prompt through 576 -> 1536
            # here): a prompt's rows go through the weight dequantized once (3.1 ms). One row stays with the
            # kernel, which writes no float copy of the weight (SmolLM2's head dequantized is 113 MB a step).
            out = flat @ self.dequantized().T  # [B * T, out]
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, Q4_GROUP, self.scales_and_zeros)
            out = out[:, : self.rows]  # [B * T, out]
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], out.shape[-1])  # [..., out]


def quantized(name: str, weight: torch.Tensor, bias: torch.Tensor | None, tensors: dict[str, np.ndarray]) -> nn.Module:
    """Matrix `name`'s quantized Linear: its file's 4-bit blocks where it has them, else int8 codes
    quantized now from its float32 weight."""
    blocks = q4_blocks(tensors, name)
    if blocks is not None:
        return Int4Linear(*blocks, bias)
    return Int8Linear(weight.detach().numpy(), bias)


def quantize_model(model: nn.Module, tensors: dict[str, np.ndarray], quant: str) -> nn.Module:
    """Every Linear of `model` (loaded in float32) swapped for its quantized twin, and the head
    of a tied model given its own, quantized from the embedding (whose lookup stays float32)."""
    assert quant in ("int8", "q4")
    wanted = tensors if quant == "q4" else {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                full = f"{name}.{child_name}" if name else child_name
                setattr(module, child_name, quantized(f"{full}.weight", child.weight, child.bias, wanted))
    if model.config.tie_embeddings:
        untie_head(model, quantized("emb.weight", model.emb.weight, None, wanted))
    return model
