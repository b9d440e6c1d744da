"""Hugging Face model directories in and out, with NumPy only (no transformers, no torch).

Import: `config.json` plus `*.safetensors` (one file or shards) of model type gpt2,
llama or mistral -> a ModelConfig and tensors in our names and (out, in) layouts.
Export: a model GPT-2 can express -> a gpt2-type directory transformers can load.

Every config field is either mapped, checked against the one value we implement, or
on a list of fields that cannot change the forward pass (ids, bookkeeping, training
dropout). Anything else is refused, naming the field: a field we skipped silently
could change the model's output without a word. Pickles (`*.bin`) are never opened.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from kvports.shared.config import DTYPES, ModelConfig
from kvports.shared.errors import UserError
from kvports.shared.files import write_atomic
from kvports.shared.weights import check_tensors, expected_shapes, read_header

MODEL_TYPES = ("gpt2", "llama", "mistral")

# Safetensors dtype -> how the bytes are read. BF16 has no NumPy dtype: its bits are
# the top half of a float32, so it is read as uint16 and shifted (see to_float).
RAW_DTYPES = {"F32": "<f4", "F64": "<f8", "F16": "<f2", "BF16": "<u2"}
KEEPABLE = {"F32": "float32", "F64": "float64"}  # the dtypes our weights file stores as they are

# Fields that never change the forward pass of a causal LM at inference: identity,
# token ids, bookkeeping, training-only dropout, generation defaults (we are greedy).
IGNORED_COMMON = {
    "_name_or_path", "architectures", "model_type", "dtype", "torch_dtype", "transformers_version",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "initializer_range", "use_cache", "tokenizer_class", "id2label", "label2id", "num_labels",
    "problem_type", "task_specific_params", "prefix", "return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "use_bfloat16", "tf_legacy_loss", "finetuning_task",
    "gradient_checkpointing", "chunk_size_feed_forward", "is_decoder", "is_encoder_decoder",
    "tie_encoder_decoder", "cross_attention_hidden_size", "max_length", "min_length", "do_sample",
    "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k",
    "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
}
IGNORED = {
    # Dropout is training-only; summary_* configure GPT2DoubleHeadsModel's extra head;
    # n_ctx is the pre-2020 duplicate of n_positions; reorder_and_upcast_attn only
    # changes the order of a float32 upcast used in mixed-precision training.
    "gpt2": {"attn_pdrop", "embd_pdrop", "resid_pdrop", "summary_type", "summary_use_proj",
             "summary_activation", "summary_proj_to_labels", "summary_first_dropout", "n_ctx",
             "reorder_and_upcast_attn"},
    # pretraining_tp only split matmuls into slices (same result) and is unused in transformers 5.
    "llama": {"attention_dropout", "pretraining_tp"},
    "mistral": {"attention_dropout"},
}


def refuse(field: str, value: Any, why: str) -> UserError:
    return UserError(f"config.json field {field}={json.dumps(value)}: {why}")


def read_hf_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not directory.is_dir():
        raise UserError(f"Hugging Face directory {str(directory)!r} does not exist or is not a folder")
    if not path.is_file():
        raise UserError(f"{str(directory)!r} has no config.json")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{str(path)!r} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"{str(path)!r} must hold a JSON object")
    return data


class Fields:
    """config.json read field by field; whatever was not read at the end is refused."""

    def __init__(self, data: dict, model_type: str):
        self.data, self.model_type = data, model_type
        self.seen = set(IGNORED_COMMON) | IGNORED[model_type]

    def get(self, name: str, default: Any = None) -> Any:
        self.seen.add(name)
        value = self.data.get(name, default)
        return default if value is None else value

    def integer(self, name: str, default: Any = None) -> int:
        value = self.get(name, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise refuse(name, value, "must be an integer >= 1")
        return value

    def number(self, name: str, default: Any = None) -> float:
        value = self.get(name, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise refuse(name, value, "must be a number > 0")
        return float(value)

    def flag(self, name: str, default: bool) -> bool:
        value = self.get(name, default)
        if not isinstance(value, bool):
            raise refuse(name, value, "must be true or false")
        return value

    def require(self, name: str, allowed: Tuple[Any, ...], why: str) -> Any:
        """A field we implement for one value (or a few) only."""
        self.seen.add(name)
        value = self.data.get(name, allowed[0])
        if value not in allowed:
            raise refuse(name, value, why)
        return value

    def refuse_unread(self) -> None:
        for name in sorted(self.data):
            if name not in self.seen:
                raise refuse(name, self.data[name], f"kvports does not model this {self.model_type} field; "
                                                    "refusing rather than ignoring it")


def gpt2_config(fields: Fields) -> ModelConfig:
    activations = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
    # GPT2Config's default is "gelu_new" (tanh); "gelu" is the exact erf form.
    activation = fields.require("activation_function", ("gelu_new", "gelu", "gelu_pytorch_tanh"),
                                f"supported: {', '.join(activations)}")
    fields.require("scale_attn_weights", (True,), "kvports always scales attention by 1/sqrt(head_dim)")
    fields.require("scale_attn_by_inverse_layer_idx", (False,), "kvports does not scale attention by layer index")
    fields.require("add_cross_attention", (False,), "kvports is decoder-only, without cross-attention")
    fields.require("pruned_heads", ({},), "pruned heads are not supported")
    n_embd = fields.integer("n_embd", 768)
    n_inner = fields.get("n_inner")
    return ModelConfig(
        vocab_size=fields.integer("vocab_size", 50257), d_model=n_embd, n_heads=fields.integer("n_head", 12),
        n_layers=fields.integer("n_layer", 12), max_seq_len=fields.integer("n_positions", 1024),
        activation=activations[activation], ffn_hidden=None if n_inner is None else fields.integer("n_inner"),
        norm="layernorm", norm_eps=fields.number("layer_norm_epsilon", 1e-5), positions="learned",
        tie_embeddings=fields.flag("tie_word_embeddings", True), attn_bias=True, ffn_bias=True)


def rope_theta(fields: Fields) -> float:
    """transformers 5 writes `rope_parameters: {rope_theta, rope_type}`; 4.x wrote top-level
    `rope_theta` and `rope_scaling`. Only plain RoPE (type "default", full head dim) is ours."""
    scaling = fields.get("rope_scaling")
    if scaling is not None:
        raise refuse("rope_scaling", scaling, "kvports implements plain RoPE only (no scaling)")
    theta = fields.get("rope_theta", 10000.0)
    params = fields.get("rope_parameters", {})
    if not isinstance(params, dict):
        raise refuse("rope_parameters", params, "must be an object")
    for key, value in params.items():
        if key in ("rope_type", "type"):
            if value != "default":
                raise refuse(f"rope_parameters.{key}", value, "kvports implements plain RoPE only (type 'default')")
        elif key == "partial_rotary_factor":
            if value != 1 and value != 1.0:
                raise refuse("rope_parameters.partial_rotary_factor", value, "kvports rotates the full head dim (1.0)")
        elif key != "rope_theta":
            raise refuse(f"rope_parameters.{key}", value, "kvports implements plain RoPE only")
    theta = params.get("rope_theta", theta)
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
        raise refuse("rope_theta", theta, "must be a number > 0")
    factor = fields.get("partial_rotary_factor", 1.0)
    if factor != 1 and factor != 1.0:
        raise refuse("partial_rotary_factor", factor, "kvports rotates the full head dim (1.0)")
    return float(theta)


def llama_config(fields: Fields) -> ModelConfig:
    mistral = fields.model_type == "mistral"
    fields.require("hidden_act", ("silu", "swish"), "kvports' SwiGLU uses silu")
    hidden = fields.integer("hidden_size", 4096)
    heads = fields.integer("num_attention_heads", 32)
    # Absent fields take transformers' defaults for the class: the model it would build.
    kv_heads = fields.integer("num_key_value_heads", 8 if mistral else heads)
    if hidden % heads:
        raise refuse("hidden_size", hidden, f"is not divisible by num_attention_heads={heads}")
    head_dim = fields.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        raise refuse("head_dim", head_dim, f"kvports needs head_dim = hidden_size / num_attention_heads = {hidden // heads}")
    if heads % kv_heads:
        raise refuse("num_key_value_heads", kv_heads, f"must divide num_attention_heads={heads}")
    layer_types = fields.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list) or len(set(map(str, layer_types))) > 1):
        raise refuse("layer_types", layer_types, "kvports runs one attention type in every layer")
    if mistral:
        # transformers' Mistral has no biases: a flag saying otherwise does not mean what it says.
        for name in ("attention_bias", "mlp_bias"):
            fields.require(name, (False,), "transformers' Mistral has no biases; kvports will not guess")
        window = fields.get("sliding_window")
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise refuse("sliding_window", window, "must be null or an integer >= 1 (the keys a query sees, itself included)")
        attn_bias = ffn_bias = False
    else:
        # Llama's attention_bias puts a bias on q, k, v and o alike: our qkv and proj
        # biases. mlp_bias puts one on gate, up and down: our ffn.0 and ffn.2.
        attn_bias, ffn_bias, window = fields.flag("attention_bias", False), fields.flag("mlp_bias", False), None
    return ModelConfig(
        vocab_size=fields.integer("vocab_size", 32000), d_model=hidden, n_heads=heads,
        n_layers=fields.integer("num_hidden_layers", 32),
        max_seq_len=fields.integer("max_position_embeddings", 4096 * 32 if mistral else 2048),
        n_kv_heads=kv_heads, activation="swiglu", ffn_hidden=fields.integer("intermediate_size", 14336 if mistral else 11008),
        norm="rmsnorm", norm_eps=fields.number("rms_norm_eps", 1e-6), positions="rope", rope_theta=rope_theta(fields),
        tie_embeddings=fields.flag("tie_word_embeddings", False), attn_bias=attn_bias, ffn_bias=ffn_bias,
        sliding_window=window)


def config_from_hf(data: dict) -> ModelConfig:
    model_type = data.get("model_type")
    if model_type not in MODEL_TYPES:
        raise refuse("model_type", model_type, f"supported: {', '.join(MODEL_TYPES)}")
    fields = Fields(data, model_type)
    config = gpt2_config(fields) if model_type == "gpt2" else llama_config(fields)
    fields.refuse_unread()
    return config.validate()


# --- safetensors, read by hand --------------------------------------------------------

def safetensors_files(directory: Path) -> List[Path]:
    """The shards the index names, or every *.safetensors; a pickle-only directory is refused."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
            raise UserError(f"{str(index)!r} is not a safetensors index (expected a 'weight_map' object)") from None
        for name in names:
            if not isinstance(name, str) or Path(name).name != name or not (directory / name).is_file():
                raise UserError(f"{str(index)!r} names shard {name!r}, which is not a file in {str(directory)!r}")
        return [directory / name for name in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        found = f" (found {', '.join(pickles)}: pickles, which kvports never loads)" if pickles else ""
        raise UserError(f"{str(directory)!r} has no *.safetensors file{found}; convert it to safetensors first")
    return files


def read_safetensors(path: Path) -> Dict[str, Tuple[str, np.ndarray]]:
    """{name: (safetensors dtype, raw array)}, memory-mapped; bf16 comes back as uint16 bits."""
    header, _ = read_header(path)
    with path.open("rb") as handle:
        data_start = 8 + int.from_bytes(handle.read(8), "little")
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    out: Dict[str, Tuple[str, np.ndarray]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = info.get("dtype"), info.get("shape")
        if dtype not in RAW_DTYPES:
            raise UserError(f"tensor {name!r} in {path.name} has dtype {dtype}; kvports reads {', '.join(RAW_DTYPES)}")
        if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
            raise UserError(f"tensor {name!r} in {path.name} has a malformed shape {shape!r}")
        start, end = info["data_offsets"]
        numpy_dtype = np.dtype(RAW_DTYPES[dtype])
        if end - start != math.prod(shape) * numpy_dtype.itemsize:
            raise UserError(f"tensor {name!r} in {path.name}: shape {shape} of {dtype} needs "
                            f"{math.prod(shape) * numpy_dtype.itemsize} bytes, its offsets hold {end - start}")
        out[name] = (dtype, raw[data_start + start : data_start + end].view(numpy_dtype).reshape(shape))
    return out


def to_float(dtype: str, array: np.ndarray, target: str) -> np.ndarray:
    if dtype == "BF16":
        array = (array.astype(np.uint32) << 16).view(np.float32)  # bf16 is float32's top 16 bits
    return np.array(array, dtype=target)  # a copy: the memmap closes with the file


def load_hf_tensors(directory: Path, dtype: Optional[str]) -> Tuple[Dict[str, np.ndarray], str]:
    """All tensors of the directory as float arrays of one dtype: the file's own (F32 or
    F64) or, if `dtype` is given, that one. Half-precision files need `dtype`."""
    raw: Dict[str, Tuple[str, np.ndarray]] = {}
    for path in safetensors_files(directory):
        for name, item in read_safetensors(path).items():
            if name in raw:
                raise UserError(f"tensor {name!r} appears in more than one shard of {str(directory)!r}")
            raw[name] = item
    found = sorted({dt for dt, _ in raw.values()})
    if dtype is None:
        unkeepable = [dt for dt in found if dt not in KEEPABLE]
        if unkeepable:
            example = next(name for name, (dt, _) in raw.items() if dt == unkeepable[0])
            raise UserError(f"tensor {example!r} has dtype {unkeepable[0]}; our weights hold {', '.join(DTYPES)}: "
                            "pass --dtype float32 or --dtype float64 to cast it")
        if len(found) > 1:
            raise UserError(f"{str(directory)!r} mixes dtypes {', '.join(found)}; pass --dtype to choose one")
        dtype = KEEPABLE[found[0]] if found else "float32"
    return {name: to_float(dt, array, dtype) for name, (dt, array) in raw.items()}, dtype


# --- tensor names -------------------------------------------------------------------

class HFTensors:
    """The checkpoint's tensors, taken by name and checked for shape; leftovers are refused."""

    def __init__(self, tensors: Dict[str, np.ndarray], prefix: str):
        # LMHeadModel/ForCausalLM checkpoints prefix the body ("transformer.", "model.");
        # bare GPT2Model/LlamaModel ones (and the original GPT-2 files) do not.
        self.tensors = {}
        for name, array in tensors.items():
            short = name[len(prefix):] if name.startswith(prefix) else name
            if short in self.tensors:
                raise UserError(f"tensor {name!r} appears both with and without the {prefix!r} prefix")
            self.tensors[short] = array
        self.prefix = prefix
        self.taken: set = set()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def full_name(self, name: str) -> str:
        return name if name == "lm_head.weight" else self.prefix + name

    def take(self, name: str, shape: Tuple[int, ...]) -> np.ndarray:
        if name not in self.tensors:
            raise UserError(f"missing tensor {self.full_name(name)!r} (expected shape {list(shape)})")
        array = self.tensors[name]
        if tuple(array.shape) != tuple(shape):
            raise UserError(f"tensor {self.full_name(name)!r} has shape {list(array.shape)}, the config needs {list(shape)}")
        self.taken.add(name)
        return array

    def drop(self, name: str) -> None:
        self.taken.add(name)

    def refuse_leftovers(self) -> None:
        for name in sorted(self.tensors):
            if name not in self.taken:
                raise UserError(f"unexpected tensor {self.full_name(name)!r} of shape {list(self.tensors[name].shape)}: "
                                "not part of the model this config describes")


def tied_head(hf: HFTensors, config: ModelConfig, emb: np.ndarray) -> None:
    """A tied checkpoint may still store lm_head (a copy); a different one would be dropped silently."""
    if hf.has("lm_head.weight"):
        head = hf.take("lm_head.weight", (config.vocab_size, config.d_model))
        if not np.array_equal(head, emb):
            raise UserError("tensor 'lm_head.weight' differs from the embedding, but tie_word_embeddings=true "
                            "says the head is the embedding; set tie_word_embeddings=false to use it")


def gpt2_tensors(hf: HFTensors, config: ModelConfig) -> Dict[str, np.ndarray]:
    D, V, F = config.d_model, config.vocab_size, config.ffn_dim
    out = {"emb.weight": hf.take("wte.weight", (V, D)), "pos.weight": hf.take("wpe.weight", (config.max_seq_len, D))}
    for i in range(config.n_layers):
        h, b = f"h.{i}.", f"blocks.{i}."
        # The causal-mask buffers older GPT-2 files carry; constants, not weights.
        for buffer in ("attn.bias", "attn.masked_bias"):
            if hf.has(h + buffer):
                hf.drop(h + buffer)
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out[f"{b}{ours}.weight"] = hf.take(f"{h}{theirs}.weight", (D,))
            out[f"{b}{ours}.bias"] = hf.take(f"{h}{theirs}.bias", (D,))
        # GPT-2's Conv1D stores weights (in, out); ours are (out, in) like nn.Linear.
        for ours, theirs, n_in, n_out in (("qkv", "attn.c_attn", D, 3 * D), ("proj", "attn.c_proj", D, D),
                                          ("ffn.0", "mlp.c_fc", D, F), ("ffn.2", "mlp.c_proj", F, D)):
            out[f"{b}{ours}.weight"] = hf.take(f"{h}{theirs}.weight", (n_in, n_out)).T.copy()
            out[f"{b}{ours}.bias"] = hf.take(f"{h}{theirs}.bias", (n_out,))
    out["ln.weight"], out["ln.bias"] = hf.take("ln_f.weight", (D,)), hf.take("ln_f.bias", (D,))
    if config.tie_embeddings:
        tied_head(hf, config, out["emb.weight"])
    else:
        out["head.weight"] = hf.take("lm_head.weight", (V, D))
    return out


def llama_tensors(hf: HFTensors, config: ModelConfig) -> Dict[str, np.ndarray]:
    D, V, F = config.d_model, config.vocab_size, config.ffn_dim
    Dh, H, Hkv = config.head_dim, config.n_heads, config.kv_heads
    out = {"emb.weight": hf.take("embed_tokens.weight", (V, D))}
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, Dh, 2, dtype=np.float64) / Dh))  # [Dh/2]
    for i in range(config.n_layers):
        h, b = f"layers.{i}.", f"blocks.{i}."
        out[b + "ln1.weight"] = hf.take(h + "input_layernorm.weight", (D,))
        out[b + "ln2.weight"] = hf.take(h + "post_attention_layernorm.weight", (D,))
        rows = {"q": H * Dh, "k": Hkv * Dh, "v": Hkv * Dh}
        # Our qkv Linear is q, k and v stacked along the output dim, in that order.
        out[b + "qkv.weight"] = np.concatenate([hf.take(f"{h}self_attn.{n}_proj.weight", (r, D)) for n, r in rows.items()])
        out[b + "proj.weight"] = hf.take(h + "self_attn.o_proj.weight", (D, H * Dh))
        # SwiGLU's gate and up stack into ffn.0, gate first, as our FeedForward splits them.
        out[b + "ffn.0.weight"] = np.concatenate([hf.take(h + "mlp.gate_proj.weight", (F, D)),
                                                  hf.take(h + "mlp.up_proj.weight", (F, D))])
        out[b + "ffn.2.weight"] = hf.take(h + "mlp.down_proj.weight", (D, F))
        if config.attn_bias:
            out[b + "qkv.bias"] = np.concatenate([hf.take(f"{h}self_attn.{n}_proj.bias", (r,)) for n, r in rows.items()])
            out[b + "proj.bias"] = hf.take(h + "self_attn.o_proj.bias", (D,))
        if config.ffn_bias:
            out[b + "ffn.0.bias"] = np.concatenate([hf.take(h + "mlp.gate_proj.bias", (F,)), hf.take(h + "mlp.up_proj.bias", (F,))])
            out[b + "ffn.2.bias"] = hf.take(h + "mlp.down_proj.bias", (D,))
        # Older Llama files store the RoPE frequencies; they must be the ones theta gives.
        name = h + "self_attn.rotary_emb.inv_freq"
        if hf.has(name):
            stored = hf.take(name, (Dh // 2,))
            if not np.allclose(stored, inv_freq, rtol=1e-5):
                raise UserError(f"tensor {hf.full_name(name)!r} is not plain RoPE with rope_theta={config.rope_theta}")
    out["ln.weight"] = hf.take("norm.weight", (D,))
    if config.tie_embeddings:
        tied_head(hf, config, out["emb.weight"])
    else:
        out["head.weight"] = hf.take("lm_head.weight", (V, D))
    return out


def import_hf(directory: os.PathLike, dtype: Optional[str] = None) -> Tuple[ModelConfig, Dict[str, np.ndarray]]:
    """A local Hugging Face directory -> (config, tensors in our names). Nothing is fetched."""
    directory = Path(directory)
    config = config_from_hf(read_hf_config(directory))
    tensors, dtype = load_hf_tensors(directory, dtype)
    gpt2 = config.positions == "learned"
    hf = HFTensors(tensors, "transformer." if gpt2 else "model.")
    ours = gpt2_tensors(hf, config) if gpt2 else llama_tensors(hf, config)
    hf.refuse_leftovers()
    ours = {name: np.ascontiguousarray(ours[name], dtype=dtype) for name in expected_shapes(config)}
    check_tensors(ours, config, source=str(directory))
    return config, ours


# --- export ---------------------------------------------------------------------------

def gpt2_refusal(config: ModelConfig) -> Optional[str]:
    """Why GPT-2 cannot express this model, or None if it can."""
    if config.positions != "learned":
        return f"positions={config.positions!r}: GPT-2 has learned positions"
    if config.norm != "layernorm":
        return f"norm={config.norm!r}: GPT-2 has LayerNorm"
    if config.activation not in ("gelu", "gelu_tanh"):
        return f"activation={config.activation!r}: GPT-2's MLP is not gated (gelu or gelu_tanh only)"
    if config.kv_heads != config.n_heads:
        return f"n_kv_heads={config.n_kv_heads}: GPT-2 has one k/v head per query head (n_heads={config.n_heads})"
    if config.sliding_window is not None:
        return f"sliding_window={config.sliding_window}: GPT-2 attends to every earlier token"
    return None


def gpt2_hf_config(config: ModelConfig, dtype: str) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size,
        "n_positions": config.max_seq_len, "n_embd": config.d_model, "n_layer": config.n_layers,
        "n_head": config.n_heads, "n_inner": config.ffn_hidden,  # null: 4 * n_embd, as ours
        "activation_function": "gelu" if config.activation == "gelu" else "gelu_new",
        "layer_norm_epsilon": config.norm_eps, "tie_word_embeddings": config.tie_embeddings,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "add_cross_attention": False, "attn_pdrop": config.dropout, "embd_pdrop": config.dropout,
        "resid_pdrop": config.dropout, "use_cache": True, "dtype": dtype,
        # Our vocab has no special tokens; GPT2Config's default 50256 would point outside it.
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }


def gpt2_hf_tensors(config: ModelConfig, tensors: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    out = {"transformer.wte.weight": tensors["emb.weight"], "transformer.wpe.weight": tensors["pos.weight"]}
    for i in range(config.n_layers):
        h, b = f"transformer.h.{i}.", f"blocks.{i}."
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out[f"{h}{theirs}.weight"], out[f"{h}{theirs}.bias"] = tensors[f"{b}{ours}.weight"], tensors[f"{b}{ours}.bias"]
        for ours, theirs in (("qkv", "attn.c_attn"), ("proj", "attn.c_proj"), ("ffn.0", "mlp.c_fc"), ("ffn.2", "mlp.c_proj")):
            weight = tensors[f"{b}{ours}.weight"]  # (out, in); Conv1D wants (in, out)
            out[f"{h}{theirs}.weight"] = weight.T
            # GPT-2 always has these biases; zeros compute what a bias-free layer does.
            out[f"{h}{theirs}.bias"] = tensors.get(f"{b}{ours}.bias", np.zeros(weight.shape[0], weight.dtype))
    out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = tensors["ln.weight"], tensors["ln.bias"]
    if not config.tie_embeddings:
        out["lm_head.weight"] = tensors["head.weight"]
    return {name: np.ascontiguousarray(array) for name, array in out.items()}


def export_gpt2(config: ModelConfig, tensors: Dict[str, np.ndarray], directory: os.PathLike) -> None:
    """Write config.json and model.safetensors for transformers' GPT2LMHeadModel."""
    from safetensors.numpy import save

    why = gpt2_refusal(config)
    if why is not None:
        raise UserError(f"cannot write a gpt2 model: {why}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = str(next(iter(tensors.values())).dtype)
    # "format": "pt" is what transformers checks before it loads a safetensors file.
    payload = save(gpt2_hf_tensors(config, tensors), metadata={"format": "pt"})
    # Weights first, config last: a directory with a config.json is a complete one.
    write_atomic(directory / "model.safetensors", payload)
    write_atomic(directory / "config.json", (json.dumps(gpt2_hf_config(config, dtype), indent=2, sort_keys=True) + "\n").encode())
