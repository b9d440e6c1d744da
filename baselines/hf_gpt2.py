"""Hugging Face's GPT-2 `generate` on our weights: the library baseline.

The seed's model is GPT-2's architecture with exact GELU and an untied head, so a
GPT2LMHeadModel holds it exactly; the mapping is `kvports convert --to-hf`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.generation.streamers import BaseStreamer

from kvports.baselines.seed_concat import check_seed_shaped
from kvports.shared.config import ModelConfig
from kvports.shared.hf.config import gpt2_hf_config
from kvports.shared.hf.tensors import gpt2_hf_tensors
from kvports.torch_impl import port as torch_port

NAME = "transformers"
MODES = ("cached",)


def gpt2_config(config: ModelConfig, dtype: str) -> GPT2Config:
    check_seed_shaped(config)
    fields = gpt2_hf_config(config, dtype)
    fields["pad_token_id"] = 0  # generate() wants one; our vocab has no special tokens
    return GPT2Config(**fields)


def versions() -> dict[str, str]:
    return {**torch_port.versions(), "transformers": transformers.__version__}


def load_model(
    config: ModelConfig, tensors: dict[str, np.ndarray], dtype: str = "float32", device: str = "cpu"
) -> GPT2LMHeadModel:
    target = torch_port.resolve_device(device)
    model = GPT2LMHeadModel(gpt2_config(config, dtype))
    state = {name: torch.from_numpy(array) for name, array in gpt2_hf_tensors(config, tensors).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # GPT-2 may keep non-parameter buffers (a causal-mask table) that no file carries.
    missing = [name for name in missing if name in dict(model.named_parameters())]
    assert not missing and not unexpected, f"GPT-2 names: missing {missing}, unexpected {unexpected}"
    model.generation_config.eos_token_id = None  # never stop early: every row makes N tokens
    model.generation_config.pad_token_id = 0
    return model.to(device=target, dtype=torch_port.TORCH_DTYPES[dtype]).eval()


class CallbackStreamer(BaseStreamer):
    """generate() hands a streamer the prompt, then each new token as it is chosen."""

    def __init__(self, on_token: Callable[[np.ndarray], None]):
        self.on_token = on_token
        self.seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.on_token(value.reshape(-1).cpu().numpy())  # [B]

    def end(self) -> None:
        pass


def generate(
    model: GPT2LMHeadModel,
    prompts: np.ndarray,
    new_tokens: int,
    mode: str = "cached",
    return_logits: bool = False,
    on_token: Callable[[np.ndarray], None] | None = None,
) -> tuple[np.ndarray, None]:
    """transformers' greedy generate: tokens [B, P + N] and no logits (the bench asks for none);
    on_token(token [B]) from its streamer, as each new token is chosen."""
    if mode not in MODES:
        raise ValueError(f"{NAME} has modes {MODES}, not {mode!r}")
    prompt = torch.from_numpy(np.asarray(prompts, dtype=np.int64)).to(model.device)  # [B, P]
    streamer = None if on_token is None else CallbackStreamer(on_token)
    with torch.inference_mode():
        tokens = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            do_sample=False,
            num_beams=1,
            use_cache=True,
            streamer=streamer,
        )  # [B, P + N]
    return tokens.cpu().numpy(), None


def synchronize(model: GPT2LMHeadModel) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()


matvec_seconds = torch_port.matvec_seconds
