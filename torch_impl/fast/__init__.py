"""What changes a loaded model from outside, as gpt-fast's quantize.py and tp.py do: model.py stays
the lesson, and port.load_model applies these to the model it has loaded.

- onednn.py: every linear through the CPU's fastest batch-1 route (oneDNN, MKL) and its layout
- cores.py: a decode step's large products, their output rows split across torch's threads
- row_loop.py (and row_loop.cpp): at --threads, a float32 decode step's products as a C++ loop over the
  weight's rows on torch's threads, its RMSNorms and each layer's decode attention as one C++ call each
- compiled.py: the cache a torch.compile'd forward takes, and the cached loop over it
- quant.py: int8 and 4-bit weights, each Linear swapped for its quantized twin
- parallel.py: tensor parallelism over torch.distributed ranks
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn


def untie_head(model: nn.Module, head: nn.Module) -> nn.Module:
    """A tied model given a head module of its own: TinyModel reads its config, so the config says
    untied and the logits come from `head`; the embedding's lookup stays as it was."""
    model.head = head
    model.config = dataclasses.replace(model.config, tie_embeddings=False)
    return model
