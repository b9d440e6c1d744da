"""A weights file's family in words, for the command line's titles and messages.

`ModelConfig.family` names the family; this adds the options that change the KV
cache's size or the head (what a reader comparing two files wants to see first).
"""

from __future__ import annotations

from kvports.shared.config import ModelConfig


def attention_kind(config: ModelConfig) -> str:
    if config.kv_heads == config.n_heads:
        return "MHA"
    if config.kv_heads == 1:
        return f"MQA {config.n_heads}q/1kv"
    return f"GQA {config.n_heads}q/{config.kv_heads}kv"


def describe(config: ModelConfig) -> str:
    """e.g. 'mistral model (GQA 4q/2kv, window 4, untied head)', 'qwen3 model (GQA 16q/8kv, qk-norm, tied head)'."""
    parts = [attention_kind(config)]
    if config.sliding_window is not None:
        windowed = config.n_layers - len(set(config.global_layers))
        within = f" in {windowed} of {config.n_layers} layers" if config.global_layers else ""
        parts.append(f"window {config.sliding_window}{within}")
    if config.qk_norm:
        parts.append("qk-norm")
    if config.rope_scaling != "none":
        parts.append(f"RoPE {config.rope_scaling} x{config.rope_factor:g}")
    if config.rope_freq_factors:
        parts.append(f"RoPE divided by factors up to {max(config.rope_freq_factors):g}")
    parts.append("tied head" if config.tie_embeddings else "untied head")
    return f"{config.family} model ({', '.join(parts)})"
