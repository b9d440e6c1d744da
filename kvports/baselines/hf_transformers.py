"""Hugging Face transformers' own `generate` on our weights: the library baseline, in each
family's own class: GPT2LMHeadModel for the seed's model and GPT-2, LlamaForCausalLM for
Llama, MistralForCausalLM for Mistral. The mappings are `kvports convert`'s, inverted.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from transformers.generation.streamers import BaseStreamer

from kvports.formats.hf.hf_config import gpt2_hf_config, gpt2_refusal, llama_hf_config, llama_refusal
from kvports.formats.hf.tensors import gpt2_hf_tensors, llama_hf_tensors
from kvports.shared.config import ModelConfig
from kvports.torch_impl import port as torch_port

NAME = "transformers"
MODES = ("cached",)
CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}


def hf_model_type(config: ModelConfig) -> str:
    """Which transformers class holds this model (seed-gpt is GPT-2 with its own GELU and head)."""
    if config.positions == "learned":
        why = gpt2_refusal(config)
        model_type = "gpt2"
    else:
        why = llama_refusal(config)
        model_type = "mistral" if config.sliding_window is not None else "llama"
    if why is not None:
        raise ValueError(f"transformers has no class for this model: {why}")
    return model_type


def hf_config(config: ModelConfig, dtype: str) -> Any:
    """The family's transformers config object, with a pad id generate() wants."""
    model_type = hf_model_type(config)
    fields = gpt2_hf_config(config, dtype) if model_type == "gpt2" else llama_hf_config(config, dtype)
    fields["pad_token_id"] = 0  # generate() wants one; no row is padded here
    return transformers.AutoConfig.for_model(**fields)


def hf_tensors(config: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return (gpt2_hf_tensors if hf_model_type(config) == "gpt2" else llama_hf_tensors)(config, tensors)


def versions() -> dict[str, str]:
    return {**torch_port.versions(), "transformers": transformers.__version__}


def load_model(config: ModelConfig, tensors: dict[str, np.ndarray], dtype: str = "float32", device: str = "cpu") -> Any:
    target = torch_port.resolve_device(device)
    model_class = getattr(transformers, CLASSES[hf_model_type(config)])
    model = model_class(hf_config(config, dtype))
    state = {name: torch.from_numpy(array) for name, array in hf_tensors(config, tensors).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A tied head is the embedding itself; GPT-2 may keep non-parameter buffers no file carries.
    tied = {"lm_head.weight"} if config.tie_embeddings else set()
    missing = [name for name in missing if name in dict(model.named_parameters()) and name not in tied]
    assert not missing and not unexpected, f"{model_class.__name__} names: missing {missing}, unexpected {unexpected}"
    if config.tie_embeddings:
        model.tie_weights()
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
    model: Any,
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


def load_gguf(path: Path) -> Any:
    """transformers' own model of a GGUF file (its reader, its conversion, its class), dequantized to
    float32 (GgufConfig(dequantize=True): without it, it multiplies the packed blocks in float32
    whatever dtype is asked): the referee tests/test_smollm2.py and tools/transformers_answer.py read."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent,
        gguf_file=path.name,
        dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True),
    ).eval()


def synchronize(model: Any) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()


matvec_seconds = torch_port.matvec_seconds
