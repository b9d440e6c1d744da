"""Weight-only quantization, in NumPy, for every port: the same codes and scales wherever they run.

- int8: symmetric, one scale per output channel, quantized at load from the float32 weights
  (`quantize_int8`): w ~ scale[o] * code[o, i], code in [-127, 127].
- q4: a GGUF file's own Q4_0/Q4_1 blocks of 32, kept as they are (the reader unpacks the nibbles):
  w = scale[o, g] * code[o, i] + min[o, g], code in [0, 15], g = i // 32 (Q4_0's min is -8 scale).
  They cross to the port beside the dequantized float32 weights, under `q4_names`; a matrix the
  file does not store in 4 bits goes the int8 way.
"""

from __future__ import annotations

import numpy as np

Q4_GROUP = 32  # the GGUF Q4 block: 32 weights share one scale (and Q4_1 one min)
Q4_SUFFIXES = (".q4", ".q4_scales", ".q4_mins")


def q4_names(name: str) -> tuple[str, str, str]:
    """The names of a matrix's 4-bit codes [out, in] uint8, scales and mins [out, in / 32] float32."""
    codes, scales, mins = (name + suffix for suffix in Q4_SUFFIXES)
    return codes, scales, mins


def is_q4_part(name: str) -> bool:
    return name.endswith(Q4_SUFFIXES)


def float_tensors(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The model's own tensors, without the 4-bit blocks beside them."""
    return {name: array for name, array in tensors.items() if not is_q4_part(name)}


def q4_blocks(tensors: dict[str, np.ndarray], name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Matrix `name`'s codes, scales and mins, or None where the file did not store it in 4 bits."""
    codes, scales, mins = q4_names(name)
    return None if codes not in tensors else (tensors[codes], tensors[scales], tensors[mins])


def quantize_int8(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """weight [out, in] float -> (codes [out, in] int8, scales [out] float32): symmetric, per output
    channel, round to nearest. An all-zero row gets scale 1 (its codes are 0 either way)."""
    weight = np.asarray(weight, dtype=np.float32)
    largest = np.abs(weight).max(axis=1)  # [out]
    scales = np.where(largest > 0, largest / 127, 1).astype(np.float32)  # [out]
    codes = np.clip(np.rint(weight / scales[:, None]), -127, 127).astype(np.int8)  # [out, in]
    # Rows, whatever the weight's layout: the load cache maps some matrices laid out [in, out]
    # (shapes.stored_transposed), and torch's int8 kernel takes its codes C-contiguous only.
    return np.ascontiguousarray(codes), scales
