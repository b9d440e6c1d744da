"""The model's hyperparameters, shared by every port and stored in the weights file.

Defaults are the seed's TinyModel (GPT-2-shaped: LayerNorm, learned positions,
exact-erf GELU, untied head, biases everywhere). The other fields describe the
families the same code also runs: GPT-2 (tanh GELU, tied head), Llama (RMSNorm,
RoPE, SwiGLU, GQA/MQA, no biases), Mistral (Llama plus a sliding window), and the switches
Llama 3 (RoPE frequency scaling), Qwen2 (q, k, v biases), Qwen3 (qk-norm, its own head size)
and Gemma 3 (scaled embeddings, norms after attention and the MLP, GELU-gated MLP, windowed and
global layers interleaved) add; docs/FAMILIES.md has the table of which family sets which.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvports.shared.errors import UserError, echo

ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu", "geglu_tanh")  # the last two gated: gate and up fused
ROPE_SCALINGS = ("none", "linear", "llama3")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rope")
DTYPES = ("float32", "float64", "bfloat16")
# What a weights file stores and NumPy holds: NumPy has no bfloat16, so a bfloat16 run reads its
# weights at float32 and the port casts them (host_dtype).
STORED_DTYPES = ("float32", "float64")
QUANTS = ("none", "int8", "q4")  # weight-only: int8 per output channel at load; q4 a GGUF's own 4-bit blocks


def host_dtype(dtype: str) -> str:
    """The NumPy dtype a run at compute dtype `dtype` reads and checks its weights at."""
    return "float32" if dtype == "bfloat16" else dtype


# Every size and count (vocab, widths, heads, layers, positions; a run's batch, prompt and new
# tokens) is at most this: JAX computes token ids, positions and cache slots in int32, and
# 2**30 leaves room for the sums (a position plus a chunk) to stay in range.
MAX_SIZE = 2**30
# A window needs no such bound to be computed right (the ports attend with
# `ModelConfig.for_compute`'s, at most max_seq_len); this one keeps it an int64, as every
# framework and Hugging Face's config store it.
MAX_WINDOW = 2**63 - 1
# The floats, bounded where a port could part from the others, and wide enough for every
# published checkpoint. An epsilon that is a float32 subnormal (below 1.2e-38) XLA flushes to
# zero, and an all-zero row then normalises to NaN in JAX alone: the bound is the smallest
# published epsilon (BERT's 1e-12; decoders use 1e-5 or 1e-6), far above that. A RoPE theta
# below 1 makes frequencies above 1, and angles past the positions that each framework's sin
# and cos reduce their own way (JAX's tokens parted from torch's at 1e-30); from 1 up, every
# angle is at most its position. The top is far past the largest published theta (Llama 3's
# 500000, long-context variants' few billion).
MIN_NORM_EPS = 1e-12
ROPE_THETA_RANGE = (1.0, 1e12)
# The other floats a family sets, each finite and > 0 where set (None: the default rule).
OPTIONAL_FLOATS = ("attn_scale", "rope_local_theta")
FLOATS = ("embed_scale", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", *OPTIONAL_FLOATS)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 500
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    max_seq_len: int = 512
    n_kv_heads: int | None = None  # None: = n_heads (MHA); 1: MQA; between: GQA
    activation: str = "gelu"  # exact erf GELU, as the seed's nn.GELU()
    ffn_hidden: int | None = None  # None: 4 * d_model
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    positions: str = "learned"
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    attn_bias: bool = True  # bias on qkv and proj
    ffn_bias: bool = True
    sliding_window: int | None = None  # None: full causal attention
    global_layers: tuple[int, ...] = ()  # layers that attend to every key despite the window (Gemma 3's global ones)
    head_size: int | None = None  # None: d_model / n_heads; Qwen3 and Gemma 3 set their own (q is n_heads x head_size)
    qkv_bias: bool = False  # a bias on q, k and v alone (Qwen2); attn_bias puts one on the output projection too
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before RoPE (Qwen3, Gemma 3)
    post_norms: bool = False  # a norm on attention's output and on the MLP's too, before each residual add (Gemma 3)
    embed_scale: float = 1.0  # the embeddings are multiplied by it (Gemma 3: sqrt(d_model))
    attn_scale: float | None = (
        None  # the scores' scale; None: 1 / sqrt(head_dim) (Gemma 3: query_pre_attn_scalar**-0.5)
    )
    rope_local_theta: float | None = None  # the windowed layers' RoPE base, unscaled (Gemma 3); None: rope_theta
    rope_scaling: str = "none"  # the RoPE frequencies stretched: "linear" (divided by rope_factor) or "llama3"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original_len / low are divided by rope_factor,
    rope_high_freq_factor: float = 4.0  # those below original_len / high kept, those between blended
    rope_original_len: int = 8192  # llama3: the context the model was pretrained at
    rope_freq_factors: tuple[float, ...] = ()  # a divisor per frequency: a GGUF file's rope_freqs (llama.cpp's llama3)
    dropout: float = 0.0  # training-only; generation always runs in eval mode
    eos_token_ids: tuple[int, ...] = ()  # where generation stops by default (a converted checkpoint's eos_token_id)
    bos_token_id: int | None = None  # a converted checkpoint's, kept so `convert --to-hf` writes it back

    # Derived sizes, so no port recomputes them its own way.
    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads if self.head_size is None else self.head_size

    @property
    def gated(self) -> bool:
        """The MLP's first product is gate and up fused (gate first)."""
        return self.activation in ("swiglu", "geglu_tanh")

    def layer_window(self, layer: int) -> int | None:
        """The window layer `layer` attends through, or None: every earlier key."""
        return None if layer in self.global_layers else self.sliding_window

    @property
    def ring_window(self) -> int | None:
        """The window the KV cache may keep as a ring: None where some layer sees every key."""
        return None if self.global_layers else self.sliding_window

    @property
    def ffn_dim(self) -> int:
        """The FFN's inner width (GELU models: 4 * d_model unless set; SwiGLU: the gate's and up's width)."""
        return 4 * self.d_model if self.ffn_hidden is None else self.ffn_hidden

    @property
    def qkv_dim(self) -> int:
        # q, then k, then v, fused along the output dim as in the seed's qkv Linear.
        return (self.n_heads + 2 * self.kv_heads) * self.head_dim

    @property
    def family(self) -> str:
        if self.positions == "learned":
            return "gpt2" if self.activation == "gelu_tanh" and self.tie_embeddings else "seed-gpt"
        if self.post_norms:
            return "gemma3"
        if self.qk_norm:
            return "qwen3"
        if self.qkv_bias and not self.attn_bias:
            return "qwen2"
        if self.rope_scaling == "llama3" or self.rope_freq_factors:
            return "llama3"
        return "mistral" if self.sliding_window is not None else "llama"

    def validate(self) -> ModelConfig:
        def size(name: str, value: Any, high: int = MAX_SIZE) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
                raise UserError(f"config field {name}={echo(value)} must be an integer in [1, {high}]")

        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "max_seq_len"):
            size(name, getattr(self, name))
        if self.head_size is not None:
            size("head_size", self.head_size)
        elif self.d_model % self.n_heads:
            raise UserError(f"config d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_kv_heads is not None:
            size("n_kv_heads", self.n_kv_heads)
            if self.n_heads % self.n_kv_heads:
                raise UserError(f"config n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.ffn_hidden is not None:
            size("ffn_hidden", self.ffn_hidden)
        if self.sliding_window is not None:
            size("sliding_window", self.sliding_window, MAX_WINDOW)
        if not isinstance(self.global_layers, tuple) or any(
            not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.n_layers
            for layer in self.global_layers
        ):
            raise UserError(
                f"config field global_layers={echo(self.global_layers)} must list layers in [0, {self.n_layers})"
            )
        if self.global_layers and self.sliding_window is None:
            raise UserError("config field global_layers is set without a sliding_window to be global against")
        size("rope_original_len", self.rope_original_len)
        if self.rope_scaling not in ROPE_SCALINGS:
            raise UserError(f"config rope_scaling={echo(self.rope_scaling)} is not one of {', '.join(ROPE_SCALINGS)}")
        for name, allowed in (("activation", ACTIVATIONS), ("norm", NORMS), ("positions", POSITIONS)):
            if getattr(self, name) not in allowed:
                raise UserError(f"config {name}={echo(getattr(self, name))} is not one of {', '.join(allowed)}")
        if self.positions == "rope" and self.head_dim % 2:
            raise UserError(f"config head_dim={self.head_dim} must be even for rope positions")
        for name in ("norm_eps", "rope_theta", *FLOATS):
            value = getattr(self, name)
            if value is None and name in OPTIONAL_FLOATS:
                continue
            # JSON's 1e999 is inf: a model with an infinite epsilon outputs token 0 forever.
            if not finite_number(value) or not value > 0:
                raise UserError(f"config field {name}={echo(value)} must be a finite number > 0")
        if self.norm_eps < MIN_NORM_EPS:
            raise UserError(f"config field norm_eps={echo(self.norm_eps)} is below {MIN_NORM_EPS:g}")
        low, high = ROPE_THETA_RANGE
        for name in ("rope_theta", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not low <= value <= high:
                raise UserError(f"config field {name}={echo(value)} must be in [{low:g}, {high:g}]")
        factors = self.rope_freq_factors
        if (
            not isinstance(factors, tuple)
            or factors
            and (len(factors) != self.head_dim // 2 or not all(finite_number(f) and f > 0 for f in factors))
        ):
            raise UserError(
                f"config field rope_freq_factors={echo(factors)} must be {self.head_dim // 2} finite numbers > 0"
            )
        if self.rope_scaling == "llama3" and not self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise UserError(
                f"config rope_low_freq_factor={echo(self.rope_low_freq_factor)} must be below "
                f"rope_high_freq_factor={echo(self.rope_high_freq_factor)}"
            )
        if not is_number(self.dropout) or not 0.0 <= self.dropout < 1.0:
            raise UserError(f"config field dropout={echo(self.dropout)} must be in [0, 1)")
        for name in ("tie_embeddings", "attn_bias", "ffn_bias", "qkv_bias", "qk_norm", "post_norms"):
            if not isinstance(getattr(self, name), bool):
                raise UserError(f"config field {name}={echo(getattr(self, name))} must be true or false")
        if not isinstance(self.eos_token_ids, tuple):
            raise UserError(f"config field eos_token_ids={echo(self.eos_token_ids)} must be a list of token ids")
        for token in self.eos_token_ids:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < self.vocab_size:
                raise UserError(
                    f"config field eos_token_ids has {echo(token)}, not a token id in [0, {self.vocab_size})"
                )
        if self.bos_token_id is not None and (
            not isinstance(self.bos_token_id, int)
            or isinstance(self.bos_token_id, bool)
            or not 0 <= self.bos_token_id < self.vocab_size
        ):
            raise UserError(
                f"config field bos_token_id={echo(self.bos_token_id)} is not a token id in [0, {self.vocab_size})"
            )
        return self

    def validate_at(self, dtype: str) -> ModelConfig:
        """The floats a port computes with stay finite and positive in `dtype`: an epsilon of
        1e300 is finite, but inf in float32, and every token would come out 0."""
        with np.errstate(over="ignore", under="ignore"):  # the overflow is the finding, not a warning
            eps = np.asarray(self.norm_eps, dtype=host_dtype(dtype))  # bfloat16 has float32's range
        if not (np.isfinite(eps) and eps > 0):
            raise UserError(
                f"config field norm_eps={echo(self.norm_eps)} is not a finite number > 0 in {dtype}, the compute dtype"
            )
        return self

    def for_compute(self) -> ModelConfig:
        """The config a port builds its model from: the same model, with a sliding window no
        wider than max_seq_len. A window at least that wide hides nothing (no two positions of
        a run are max_seq_len apart), and JAX's int32 mask arithmetic (query - window) wraps
        for a window past 2**31: narrowed, it is computed right in every port."""
        if self.sliding_window is None or self.sliding_window <= self.max_seq_len:
            return self
        return dataclasses.replace(self, sliding_window=self.max_seq_len)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        try:
            data = json.loads(text)
        except RecursionError:
            raise UserError("config metadata is not valid JSON (nested too deeply)") from None
        except (TypeError, ValueError) as exc:
            raise UserError(f"config metadata is not valid JSON ({exc})") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Any) -> ModelConfig:
        if not isinstance(data, dict):
            raise UserError(f"config metadata must be a JSON object, got {type(data).__name__}")
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UserError(f"config metadata has unknown field {echo(unknown[0])} (known: {', '.join(sorted(known))})")
        for name in ("eos_token_ids", "global_layers", "rope_freq_factors"):
            if isinstance(data.get(name), list):  # JSON has lists, the frozen config tuples
                data = {**data, name: tuple(data[name])}
        for name in (
            "norm_eps",
            "rope_theta",
            *FLOATS,
        ):  # JSON's 1 is an int, which torch and JAX take only within int64
            if isinstance(data.get(name), int) and not isinstance(data[name], bool):
                data = {**data, name: float(data[name]) if finite_number(data[name]) else math.inf}
        # Absent fields take the seed's values, so older files stay valid.
        return cls(**data).validate()


def is_number(value: Any) -> bool:
    """An int or a float, not a bool (JSON's true is no number)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite_number(value: Any) -> bool:
    """A number a float holds: JSON's 1e999 is inf, and an integer of 400 digits is past any float."""
    try:
        return is_number(value) and math.isfinite(value)
    except OverflowError:
        return False


def cache_slots(config: ModelConfig, total_len: int, chunk: int = 1) -> int:
    """How many positions the KV cache holds: all of them, or a ring for the sliding window.
    chunk: the widest chunk written before it is attended and then partly taken back
    (speculative verification: K + 1). The ring keeps chunk - 1 spare slots, so a write
    never destroys a key the window still needs, even one later taken back."""
    if config.ring_window is not None:
        return min(config.ring_window + chunk - 1, total_len)
    return total_len


def kv_cache_bytes(config: ModelConfig, batch: int, total_len: int, itemsize: int, chunk: int = 1) -> int:
    """Bytes of the k and v buffers (the slot-position vector is negligible and not counted);
    chunk as in cache_slots."""
    slots = cache_slots(config, total_len, chunk)
    return 2 * config.n_layers * batch * config.kv_heads * slots * config.head_dim * itemsize
