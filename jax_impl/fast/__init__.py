"""What changes a loaded model from outside, as gpt-fast's quantize.py and tp.py do: model.py stays
the lesson, and port.load_model applies these to the model it has loaded.

- layout.py: bfloat16 weights stored [out, in], the layout XLA's CPU dot is fast in
- quant.py: int8 and 4-bit weights, each Linear swapped for its quantized twin
- parallel.py: tensor parallelism over a device mesh (GSPMD under jit)
- row_loop.py: at --threads, a float32 decode step's products as a C++ loop over the weight's rows, an XLA
  custom call on XLA's own threads
"""

from __future__ import annotations

import dataclasses

from flax import nnx


def untie_head(model: nnx.Module, head: nnx.Module) -> nnx.Module:
    """A tied model given a head module of its own: TinyModel reads its config, so the config says
    untied and the logits come from `head`; the embedding's lookup stays as it was."""
    model.head = head
    model.config = dataclasses.replace(model.config, tie_embeddings=False)
    return model
