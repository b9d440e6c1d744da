"""GGUF files written by the gguf library, as llama.cpp's converter writes them: a tiny random
Llama, q/k rows permuted, matrices quantized, a byte-level BPE tokenizer and a ChatML template."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
GGUF_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: eos is <|im_end|>
GGUF_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "Ġ t", "h i", "Ġt hi"]


def byte_tokens() -> list[str]:
    """The 256 byte-level BPE characters in byte order (GPT-2's bytes_to_unicode)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [byte for byte in range(256) if byte not in printable]
    spelled = {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}
    return [spelled[byte] for byte in range(256)]


def gguf_tokens() -> list[str]:
    return [*GGUF_SPECIALS, *byte_tokens(), *(merge.replace(" ", "") for merge in GGUF_MERGES)]


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (its RoPE rotates adjacent pairs): convert_hf_to_gguf's permute."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


GGUF_SIZE = dict(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, ffn_hidden=96, max_seq_len=64)


def hf_llama_tensors(vocab: int, tie: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """A random Llama in transformers' names and layouts (q/k in halves order), at GGUF_SIZE.
    Matrices at std 0.3 so greedy tokens are a real test; norm gains around 1."""
    rng = np.random.default_rng(seed)
    D, F, Dh = GGUF_SIZE["d_model"], GGUF_SIZE["ffn_hidden"], GGUF_SIZE["d_model"] // GGUF_SIZE["n_heads"]
    kv = GGUF_SIZE["n_kv_heads"] * Dh
    shapes = {"embed_tokens.weight": (vocab, D), "norm.weight": (D,)}
    for i in range(GGUF_SIZE["n_layers"]):
        for name, shape in (
            ("input_layernorm", (D,)),
            ("post_attention_layernorm", (D,)),
            ("self_attn.q_proj", (D, D)),
            ("self_attn.k_proj", (kv, D)),
            ("self_attn.v_proj", (kv, D)),
            ("self_attn.o_proj", (D, D)),
            ("mlp.gate_proj", (F, D)),
            ("mlp.up_proj", (F, D)),
            ("mlp.down_proj", (D, F)),
        ):
            shapes[f"layers.{i}.{name}.weight"] = shape
    if not tie:
        shapes["lm_head.weight"] = (vocab, D)
    return {
        name: (1 + 0.1 * rng.standard_normal(shape) if len(shape) == 1 else 0.3 * rng.standard_normal(shape)).astype(
            np.float32
        )
        for name, shape in shapes.items()
    }


GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def edit_gguf_tensor(path: Path, name: str, part: int, value: int) -> None:
    """Overwrite one number of a tensor's entry in the file's tensor table (part 4: its type,
    part 5: its data offset), in place, through the library's own reader."""
    import gguf

    reader = gguf.GGUFReader(str(path), "r+")
    tensor = next(t for t in reader.tensors if t.name == name)
    tensor.field.parts[part][0] = value
    reader.data.flush()
    del reader


def gguf_tensor_offset(path: Path, name: str) -> int:
    """A tensor's data offset as the file's table gives it."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    offset = int(next(t for t in reader.tensors if t.name == name).field.parts[5][0])
    del reader
    return offset


def raw_gguf(path: Path, key: str, value_type: int, value: bytes) -> Path:
    """A GGUF file of one metadata key, its value given as raw bytes after its type, and no tensor:
    for what the gguf library cannot write (an array nested thousands deep) or writes slowly."""
    encoded = key.encode()
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(encoded)) + encoded
    path.write_bytes(header + struct.pack("<I", value_type) + value)
    return path


def write_gguf(
    path: Path,
    qtype: str = "F32",
    tie: bool = True,
    seed: int = 0,
    tokenizer: bool = True,
    metadata: dict | None = None,
    hf_tensors: dict[str, np.ndarray] | None = None,
    arch: str = "llama",
    big_endian: bool = False,
    chat_template: str | bytes = CHATML,
) -> Path:
    """A tiny random Llama as llama.cpp writes it: GGUF names, q/k rows permuted, matrices in
    `qtype` (norms in F32), the byte-level tokenizer above and a ChatML template in the metadata.
    metadata: keys to add or (value None) leave out; chat_template: bytes for one that is not UTF-8."""
    import gguf

    tokens = gguf_tokens()
    tensors = hf_tensors if hf_tensors is not None else hf_llama_tensors(len(tokens), tie, seed)
    endianess = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    writer = gguf.GGUFWriter(str(path), arch, endianess=endianess)
    H, Hkv = GGUF_SIZE["n_heads"], GGUF_SIZE["n_kv_heads"]
    fields: dict = {
        "llama.block_count": GGUF_SIZE["n_layers"],
        "llama.context_length": GGUF_SIZE["max_seq_len"],
        "llama.embedding_length": GGUF_SIZE["d_model"],
        "llama.feed_forward_length": GGUF_SIZE["ffn_hidden"],
        "llama.attention.head_count": H,
        "llama.attention.head_count_kv": Hkv,
        "llama.rope.freq_base": 10000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.vocab_size": len(tokens),
        "llama.rope.dimension_count": GGUF_SIZE["d_model"] // H,
    }
    fields.update(metadata or {})
    for key, value in fields.items():
        if value is None:
            continue
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(tokens)
        writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
        writer.add_token_merges(GGUF_MERGES)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(False)
        writer.add_string(gguf.Keys.Tokenizer.CHAT_TEMPLATE, chat_template)  # type: ignore[arg-type]
    kind = gguf.GGMLQuantizationType[qtype]
    for name, array in tensors.items():
        if name == "embed_tokens.weight":
            ours = "token_embd.weight"
        elif name == "norm.weight":
            ours = "output_norm.weight"
        elif name == "lm_head.weight":
            ours = "output.weight"
        else:
            _, i, rest = name.split(".", 2)
            ours = f"blk.{i}.{GGUF_NAMES[rest.removesuffix('.weight')]}.weight"
        if ".attn_q." in ours or ".attn_k." in ours:
            array = llama_cpp_permute(array, H if ".attn_q." in ours else Hkv)
        if array.ndim == 1 or kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(ours, np.ascontiguousarray(array, dtype=np.float32))
        else:
            writer.add_tensor(ours, gguf.quants.quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
