"""What the command line, the tests and the benchmark call: NumPy in, NumPy out.
The same five names in every port; only the framework calls differ."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np
import torch

from shared.config import ModelConfig
from torch_impl.model import TinyModel, generate_cached, generate_naive

NAME = "torch"
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def versions() -> Dict[str, str]:
    return {"torch": torch.__version__}


def resolve_device(device: str) -> torch.device:
    if device == "gpu":
        # float32 must mean float32 on a GPU: no TF32 matmuls.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        return torch.device("cuda")
    return torch.device("cpu")


def load_model(config: ModelConfig, tensors: Dict[str, np.ndarray], dtype: str = "float32", device: str = "cpu") -> TinyModel:
    with torch.device("meta"):
        model = TinyModel(config)  # no random init: every tensor comes from the file
    state = {name: torch.from_numpy(np.ascontiguousarray(array)) for name, array in tensors.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device=resolve_device(device), dtype=TORCH_DTYPES[dtype]).eval()


def generate(model: TinyModel, prompts: np.ndarray, new_tokens: int, mode: str,
             return_logits: bool = False) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    device = model.emb.weight.device
    prompt = torch.from_numpy(np.asarray(prompts, dtype=np.int64)).to(device)  # [B, P]
    run = generate_cached if mode == "cached" else generate_naive
    if not return_logits:
        return run(model, prompt, new_tokens).cpu().numpy(), None
    tokens, logits = run(model, prompt, new_tokens, return_logits=True)
    return tokens.cpu().numpy(), logits.cpu().numpy()  # [B, P + N], [B, N, V]


def synchronize(model: TinyModel) -> None:
    if model.emb.weight.device.type == "cuda":
        torch.cuda.synchronize()


def init_weights(config: ModelConfig, seed: int) -> Dict[str, np.ndarray]:
    """The reference initialisation: seed 0 with the default config is the seed's model."""
    torch.manual_seed(seed)
    model = TinyModel(config)
    return {name: tensor.detach().numpy().copy() for name, tensor in model.state_dict().items()}
