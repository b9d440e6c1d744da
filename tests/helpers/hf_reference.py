"""Tiny random models built with transformers' own classes, saved to disk, run by
transformers' own `generate`: the other side of every agreement test.

Imported only by tests that have already skipped when transformers is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# kind -> (transformers' config class, its causal LM class)
CLASSES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}
SIZE = dict(vocab_size=96, d_model=32, n_heads=4, n_layers=2, max_seq_len=64, ffn_hidden=48)
# transformers' default init (std 0.02) gives logits of ~1e-3 whose top two sit within
# float noise of each other; std 0.3 spreads them so greedy tokens are a real test.
INIT_STD = 0.3


@dataclass(frozen=True)
class Case:
    kind: str  # "gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma3" or "phi3"
    options: tuple[tuple[str, object], ...] = ()  # extra transformers config fields
    seed: int = 0
    prompt: tuple[int, int] = (1, 1)  # (batch, length) of the prompts this case runs

    def hf_config(self):
        import transformers

        # No special tokens: an eos in a 96-token vocab would stop generate() early.
        common = dict(
            vocab_size=SIZE["vocab_size"],
            initializer_range=INIT_STD,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
        options = dict(self.options)
        if self.kind == "gpt2":
            return transformers.GPT2Config(
                n_positions=SIZE["max_seq_len"],
                n_embd=SIZE["d_model"],
                n_layer=SIZE["n_layers"],
                n_head=SIZE["n_heads"],
                n_inner=SIZE["ffn_hidden"],
                **common,
                **options,
            )
        llama_like = dict(
            hidden_size=SIZE["d_model"],
            intermediate_size=SIZE["ffn_hidden"],
            num_hidden_layers=SIZE["n_layers"],
            num_attention_heads=SIZE["n_heads"],
            max_position_embeddings=SIZE["max_seq_len"],
            **common,
        )
        return getattr(transformers, CLASSES[self.kind][0])(**{**llama_like, **options})

    def build(self, dtype: torch.dtype = torch.float32):
        import transformers

        torch.manual_seed(self.seed)
        model = getattr(transformers, CLASSES[self.kind][1])(self.hf_config()).eval()
        with torch.no_grad():
            # Norm gains and biases start at 1 and 0; random ones make sure each lands in
            # the right place (a swapped ln1/ln2 or a dropped bias would still agree otherwise).
            for param in model.parameters():
                if param.ndim == 1:
                    param.add_(0.1 * torch.randn_like(param))
        return model.to(dtype)


# Prompt shapes vary across cases rather than multiply them: each new shape costs every
# port a run and JAX a compilation, and the cases already cover lengths 1 to 7 and batches.
CASES: dict[str, Case] = {
    "gpt2-tied": Case("gpt2", prompt=(2, 3)),  # GPT2Config's defaults: tied head, tanh GELU ("gelu_new")
    "llama-mha-untied": Case("llama", (("num_key_value_heads", 4),), seed=1, prompt=(1, 1)),
    "llama-mha-tied": Case("llama", (("num_key_value_heads", 4), ("tie_word_embeddings", True)), seed=2, prompt=(2, 5)),
    "llama-gqa-untied": Case("llama", (("num_key_value_heads", 2),), seed=3, prompt=(1, 7)),
    "llama-mqa-tied": Case("llama", (("num_key_value_heads", 1), ("tie_word_embeddings", True)), seed=4, prompt=(2, 2)),
    "llama-gqa-biases": Case(
        "llama", (("num_key_value_heads", 2), ("attention_bias", True), ("mlp_bias", True)), seed=5, prompt=(1, 4)
    ),
    # The window (4) is shorter than the prompt (6) and than prompt + generation (16).
    "mistral-window": Case("mistral", (("num_key_value_heads", 2), ("sliding_window", 4)), seed=6, prompt=(2, 6)),
}
# The families built on Llama, each a switch or a few (docs/FAMILIES.md), in several sizes.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0}
# original_max_position_embeddings 16 with Dh 8: one frequency kept, one blended, two divided by the factor.
LLAMA3_ROPE |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 16}
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
FAMILY_CASES: dict[str, Case] = {
    "llama3-gqa-tied": Case(
        "llama",
        (("num_key_value_heads", 2), ("tie_word_embeddings", True), ("rope_parameters", LLAMA3_ROPE)),
        seed=7,
        prompt=(1, 5),
    ),
    "qwen2-gqa-tied": Case("qwen2", (("num_key_value_heads", 2), ("tie_word_embeddings", True)), seed=8, prompt=(2, 3)),
    "qwen2-mha-untied-wide": Case(
        "qwen2", (("num_key_value_heads", 6), ("hidden_size", 48), ("num_attention_heads", 6)), seed=9, prompt=(1, 4)
    ),
    # head_dim 16 with 4 heads of a 32-wide model: q is 64 wide, the output projection 64 -> 32.
    "qwen3-gqa-untied": Case("qwen3", (("num_key_value_heads", 2), ("head_dim", 16)), seed=10, prompt=(1, 6)),
    "qwen3-mqa-tied": Case(
        "qwen3", (("num_key_value_heads", 1), ("head_dim", 4), ("tie_word_embeddings", True)), seed=11, prompt=(2, 2)
    ),
    # A window of 3 under a 6-token prompt, two windowed layers and a global one between them, each
    # kind with its own RoPE base; the scale from query_pre_attn_scalar, not head_dim.
    "gemma3-window-gqa-tied": Case(
        "gemma3",
        (
            ("num_key_value_heads", 2),
            ("head_dim", 16),
            ("num_hidden_layers", 3),
            ("sliding_window", 3),
            ("layer_types", ["sliding_attention", "full_attention", "sliding_attention"]),
            ("query_pre_attn_scalar", 24),
            ("rope_parameters", GEMMA3_ROPE),
        ),
        seed=12,
        prompt=(2, 6),
    ),
    "gemma3-mqa-untied": Case(
        "gemma3",
        (("num_key_value_heads", 1), ("head_dim", 8), ("tie_word_embeddings", False), ("sliding_window", 4)),
        seed=13,
        prompt=(1, 5),
    ),
    # Gemma 3 as llama.cpp runs it (its GGUF file holds neither layer_types nor query_pre_attn_scalar):
    # every sixth layer global, the scores scaled by 1 / sqrt(head_dim).
    "gemma3-six-layers": Case(
        "gemma3",
        (
            ("num_key_value_heads", 2),
            ("head_dim", 8),
            ("num_hidden_layers", 6),
            ("sliding_window", 3),
            ("query_pre_attn_scalar", 8),
            ("rope_parameters", GEMMA3_ROPE),
        ),
        seed=15,
        prompt=(1, 6),
    ),
    "phi3-window-gqa": Case("phi3", (("num_key_value_heads", 2), ("sliding_window", 4)), seed=14, prompt=(1, 6)),
}


def save_hf(model, directory: Path, **kwargs) -> Path:
    model.save_pretrained(directory, **kwargs)
    return directory


@torch.no_grad()
def hf_generate(model, prompts: np.ndarray, new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """transformers' greedy generate (its own KV cache): tokens [B, P + N] and step logits [B, N, V].
    Rows of different lengths come left-padded with PAD: transformers gets id 0 there, masked out."""
    prompts = np.asarray(prompts, dtype=np.int64)
    input_ids = torch.from_numpy(np.maximum(prompts, 0))
    out = model.generate(
        input_ids,
        attention_mask=torch.from_numpy((prompts >= 0).astype(np.int64)),
        pad_token_id=0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    logits = torch.stack(out.logits, dim=1)  # [B, N, V]
    return out.sequences.numpy(), logits.to(torch.float64).numpy()
