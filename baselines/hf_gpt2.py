"""Hugging Face's GPT-2 `generate` on our weights: the library baseline.

The seed's model is GPT-2's architecture with exact GELU and an untied head, so a
GPT2LMHeadModel holds it exactly. The name mapping is small on purpose, so it can
be swapped for shared/convert's when that lands.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import numpy as np
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.generation.streamers import BaseStreamer

from baselines.seed_concat import check_seed_shaped
from shared.config import ModelConfig
from torch_impl import port as torch_port

NAME = "transformers"
MODES = ("cached",)

# Ours -> GPT-2's, per block. GPT-2's Conv1D stores (in, out): the transpose of our Linear.
BLOCK_NAMES = {
    "ln1.weight": ("ln_1.weight", False), "ln1.bias": ("ln_1.bias", False),
    "ln2.weight": ("ln_2.weight", False), "ln2.bias": ("ln_2.bias", False),
    "qkv.weight": ("attn.c_attn.weight", True), "qkv.bias": ("attn.c_attn.bias", False),
    "proj.weight": ("attn.c_proj.weight", True), "proj.bias": ("attn.c_proj.bias", False),
    "ffn.0.weight": ("mlp.c_fc.weight", True), "ffn.0.bias": ("mlp.c_fc.bias", False),
    "ffn.2.weight": ("mlp.c_proj.weight", True), "ffn.2.bias": ("mlp.c_proj.bias", False),
}
TOP_NAMES = {"emb.weight": "transformer.wte.weight", "pos.weight": "transformer.wpe.weight",
             "ln.weight": "transformer.ln_f.weight", "ln.bias": "transformer.ln_f.bias", "head.weight": "lm_head.weight"}


def gpt2_config(config: ModelConfig) -> GPT2Config:
    check_seed_shaped(config)
    return GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.max_seq_len, n_embd=config.d_model,
        n_layer=config.n_layers, n_head=config.n_heads, n_inner=config.hidden,
        activation_function="gelu",  # exact erf, as the seed's nn.GELU(); GPT-2's own is "gelu_new" (tanh)
        layer_norm_epsilon=config.norm_eps, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        scale_attn_weights=True, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )


def gpt2_state_dict(tensors: Dict[str, np.ndarray], config: ModelConfig) -> Dict[str, torch.Tensor]:
    state = {}
    for name, array in tensors.items():
        if name in TOP_NAMES:
            target, transpose = TOP_NAMES[name], False
        else:
            _, layer, rest = name.split(".", 2)  # blocks.{i}.{rest}
            gpt2_name, transpose = BLOCK_NAMES[rest]
            target = f"transformer.h.{layer}.{gpt2_name}"
        state[target] = torch.from_numpy(np.ascontiguousarray(array.T if transpose else array))
    assert len(state) == len(tensors), "two of our tensors mapped to one GPT-2 name"
    return state


def versions() -> Dict[str, str]:
    return {**torch_port.versions(), "transformers": transformers.__version__}


def load_model(config: ModelConfig, tensors: Dict[str, np.ndarray], dtype: str = "float32", device: str = "cpu") -> GPT2LMHeadModel:
    target = torch_port.resolve_device(device)
    model = GPT2LMHeadModel(gpt2_config(config))
    missing, unexpected = model.load_state_dict(gpt2_state_dict(tensors, config), strict=False)
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


def generate_stream(model: GPT2LMHeadModel, prompts: np.ndarray, new_tokens: int, mode: str,
                    on_token: Optional[Callable[[np.ndarray], None]]) -> np.ndarray:
    if mode not in MODES:
        raise ValueError(f"{NAME} has modes {MODES}, not {mode!r}")
    prompt = torch.from_numpy(np.asarray(prompts, dtype=np.int64)).to(model.device)  # [B, P]
    streamer = None if on_token is None else CallbackStreamer(on_token)
    with torch.inference_mode():
        tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                do_sample=False, num_beams=1, use_cache=True,
                                streamer=streamer)  # [B, P + N]
    return tokens.cpu().numpy()


def generate(model: GPT2LMHeadModel, prompts: np.ndarray, new_tokens: int, mode: str = "cached",
             return_logits: bool = False) -> Tuple[np.ndarray, None]:
    return generate_stream(model, prompts, new_tokens, mode, None), None


def synchronize(model: GPT2LMHeadModel) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()


matvec_seconds = torch_port.matvec_seconds
