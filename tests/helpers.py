"""What the test files share: the seed's golden tokens, ports by name, weights and prompts
for any config, and the assertions that compare ports. Imported as `tests.helpers`, the
one way; conftest.py holds only fixtures and session settings."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvports import registry
from kvports.agreement import Agreement, compare_tokens
from kvports.cli import main
from kvports.shared.config import ModelConfig
from kvports.shared.contract import Port

GOLDEN = [
    315,
    391,
    221,
    120,
    342,
    371,
    223,
    418,
    20,
    350,
    493,
    286,
    342,
    444,
    438,
    281,
    424,
    121,
    456,
    214,
    244,
    113,
    142,
    198,
    381,
    65,
    409,
    15,
    299,
    483,
    94,
    398,
    454,
    387,
    344,
    214,
    477,
    230,
    223,
    421,
    43,
    481,
    172,
    103,
    26,
    252,
    226,
    134,
    492,
    358,
    243,
    34,
    493,
    458,
    337,
    495,
    17,
    249,
    435,
    301,
    360,
    432,
    374,
    274,
    316,
    57,
    82,
    163,
    122,
    421,
    136,
    41,
    383,
    107,
    467,
    143,
    424,
    456,
    239,
    391,
    253,
    301,
    279,
    358,
    491,
    390,
    366,
    444,
    476,
    464,
    136,
    428,
    29,
    194,
    175,
    46,
    147,
    83,
    75,
    289,
]  # the seed's README: torch.manual_seed(0) model, 100 greedy tokens
SEED_PROMPT = np.array([[160, 248, 104, 209, 394]], dtype=np.int64)  # [1, 5]


# A tiny model of each family the ports run beyond the seed's: tied GPT-2, GQA Llama, and Mistral
# with a window of 4 (shorter than any prompt + generation that uses it).
LLAMA_PARTS = {"positions": "rope", "norm": "rmsnorm", "activation": "swiglu", "attn_bias": False, "ffn_bias": False}


def llama_like(**sizes) -> ModelConfig:
    """A config in Llama's architecture (RoPE, RMSNorm, SwiGLU, no biases) at the given sizes."""
    return ModelConfig(**LLAMA_PARTS, **sizes)


_LLAMA = llama_like(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, max_seq_len=48)
TINY_FAMILIES = {
    "gpt2": ModelConfig(
        vocab_size=64, d_model=32, n_heads=4, n_layers=2, max_seq_len=48, activation="gelu_tanh", tie_embeddings=True
    ),
    "llama": _LLAMA,
    "mistral": dataclasses.replace(_LLAMA, sliding_window=4, tie_embeddings=True),
}


def port_or_skip(name: str) -> Port:
    """The port, skipping only where its framework is not installed: a port that fails to import is a failure."""
    missing = registry.missing_packages(name)
    if missing:
        pytest.skip(f"{name} is not installed ({', '.join(missing)} missing)")
    return registry.load_port(name)


def hide_port(monkeypatch: pytest.MonkeyPatch, name: str, reason: str) -> None:
    """From here on, loading port `name` fails as it does where the framework is not installed."""
    real = registry.load_port

    def load_port(wanted: str) -> Port:
        if wanted == name:
            raise registry.PortUnavailable(wanted, reason)
        return real(wanted)

    monkeypatch.setattr(registry, "load_port", load_port)


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Weights for any config, from the reference initialisation (torch)."""
    return port_or_skip("torch").init_weights(config, seed)  # type: ignore[attr-defined]


def random_prompts(vocab_size: int, batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, size=(batch, length), dtype=np.int64)  # [B, P]


def run_cli(capsys: pytest.CaptureFixture, *argv: object) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `kvports ARGV...`, run in this process."""
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_error_line(code: int, out: str, err: str) -> str:
    """A user error as every command reports one: exit 2, nothing on stdout, one `error:` line; the line."""
    assert (code, out) == (2, ""), (code, out, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err  # one line, no traceback
    return err


def assert_same_tensors(expected: dict[str, np.ndarray], actual: dict[str, np.ndarray]) -> None:
    assert sorted(actual) == sorted(expected)
    for name in expected:
        np.testing.assert_array_equal(actual[name], expected[name], err_msg=name)


def assert_tokens_agree(
    reference_tokens: np.ndarray, reference_logits: np.ndarray, tokens: np.ndarray, prompt_len: int, label: str = ""
) -> Agreement:
    """Equal tokens, or a divergence at a float near-tie of the reference (margin < NEAR_TIE),
    which is reported, not failed: two frameworks' float32 logits differ in the last bits."""
    agreement = compare_tokens(reference_tokens, tokens, prompt_len, reference_logits)
    if agreement.agree:
        return agreement
    assert agreement.explained, f"{label}: {agreement.describe()}"
    warnings.warn(f"{label}: {agreement.describe()}", stacklevel=2)
    return agreement


def assert_logits_close(
    reference_logits: np.ndarray, logits: np.ndarray, atol: float, agreement: Agreement | None = None, label: str = ""
) -> None:
    """Step logits allclose up to the first divergent step (after it the histories differ)."""
    steps = reference_logits.shape[1] if agreement is None or agreement.agree else agreement.first_divergent_step + 1
    np.testing.assert_allclose(logits[:, :steps], reference_logits[:, :steps], atol=atol, rtol=0, err_msg=label)


# --- Hugging Face directories written by hand (no transformers) ---------------------------

D, H, F, V, L = 16, 4, 24, 40, 2  # a small Llama: width, heads, FFN width, vocabulary, layers


def llama_config(**changes) -> dict:
    """A config.json as transformers 5.24 writes it for LlamaForCausalLM (GQA 4q/2kv)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "dtype": "float32",
        "eos_token_id": 2,
        "head_dim": D // H,
        "hidden_act": "silu",
        "hidden_size": D,
        "initializer_range": 0.02,
        "intermediate_size": F,
        "max_position_embeddings": 32,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": H,
        "num_hidden_layers": L,
        "num_key_value_heads": 2,
        "pad_token_id": None,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "transformers_version": "5.24.0",
        "use_cache": True,
        "vocab_size": V,
    }
    config.update(changes)
    return config


def mistral_config(**changes) -> dict:
    config = llama_config(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=4)
    for name in ("attention_bias", "mlp_bias", "pretraining_tp"):
        del config[name]  # transformers' Mistral has no such fields
    config.update(changes)
    return config


def llama_tensors(config: dict, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    Dh = D // H
    kv = config["num_key_value_heads"] * Dh
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (D,),
                p + "post_attention_layernorm.weight": (D,),
                p + "self_attn.q_proj.weight": (D, D),
                p + "self_attn.k_proj.weight": (kv, D),
                p + "self_attn.v_proj.weight": (kv, D),
                p + "self_attn.o_proj.weight": (D, D),
                p + "mlp.gate_proj.weight": (F, D),
                p + "mlp.up_proj.weight": (F, D),
                p + "mlp.down_proj.weight": (D, F),
            }
        )
    if config.get("tie_word_embeddings"):
        del shapes["lm_head.weight"]
    return {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}


def write_hf_dir(directory: Path, config: dict, tensors: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def calling_internals(port: Port) -> contextlib.AbstractContextManager:
    """The context for a test that calls a port's model.py, sampling.py, generate.py or speculative.py
    directly: the JAX port's own calls run in JAX's x64 mode (jax_impl/port.py's `exact`), which is
    not on for the process, so such a test turns it on as they do."""
    if port.NAME == "jax":
        import jax

        return jax.enable_x64(True)
    return contextlib.nullcontext()


# --- GGUF files written by the gguf library, as llama.cpp's converter writes them ------------

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


def write_gguf(
    path: Path,
    qtype: str = "F32",
    tie: bool = True,
    seed: int = 0,
    tokenizer: bool = True,
    metadata: dict | None = None,
    hf_tensors: dict[str, np.ndarray] | None = None,
    arch: str = "llama",
) -> Path:
    """A tiny random Llama as llama.cpp writes it: GGUF names, q/k rows permuted, matrices in
    `qtype` (norms in F32), the byte-level tokenizer above and a ChatML template in the metadata.
    metadata: keys to add or (value None) leave out."""
    import gguf

    tokens = gguf_tokens()
    tensors = hf_tensors if hf_tensors is not None else hf_llama_tensors(len(tokens), tie, seed)
    writer = gguf.GGUFWriter(str(path), arch)
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
        writer.add_chat_template(CHATML)
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


# --- processes -------------------------------------------------------------------------------


def running(pids: list[int], wait: float = 0.0) -> list[int]:
    """The processes of `pids` still running (a zombie, ended but not yet reaped, is not), after
    waiting up to `wait` seconds for them to end."""
    deadline = time.monotonic() + wait
    while True:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                if os.path.exists("/proc"):  # Linux: a zombie answers the signal
                    with open(f"/proc/{pid}/stat") as stat:
                        if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                            continue
            except (ProcessLookupError, FileNotFoundError):
                continue
            alive.append(pid)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


# --- tensor parallelism: JAX's simulated devices exist only in a process that asked before JAX started

TP_SIZES = (1, 2, 4)
TP_CASES = {  # name -> (mode, GenerationConfig fields, with a draft model)
    "cached_greedy": ("cached", dict(max_new_tokens=6), False),
    "cached_sampled": ("cached", dict(max_new_tokens=6, temperature=0.9, top_k=20, seed=3), False),
    "speculative_sampled": ("speculative", dict(max_new_tokens=6, temperature=0.9, seed=5), True),
}


def tensor_parallel_runs(out: str, dtype: str = "float64", cases: tuple[str, ...] = tuple(TP_CASES)) -> None:
    """Every tiny family x TP_CASES x TP_SIZES through the JAX port, saved to `out` (.npz): tokens,
    step logits, and the KV cache's and a qkv kernel's partition specs. Run in a subprocess that
    asks for 4 simulated devices (`tensor_parallel_subprocess`)."""
    import jax

    from kvports.jax_impl import generate as jax_generate
    from kvports.jax_impl import port as jax_port
    from kvports.jax_impl.split import split_model
    from kvports.shared.generation import GenerationConfig

    prompts = np.array([[-1, 5, 9, 2], [7, 3, 11, 4]])  # [2, 4]: a left-padded row (PAD = -1) and a full one
    saved: dict[str, np.ndarray] = {}
    for family, config in TINY_FAMILIES.items():
        tensors = {name: array.astype(dtype) for name, array in random_weights(config).items()}
        draft_config = dataclasses.replace(config, n_layers=1)
        draft_tensors = {name: array.astype(dtype) for name, array in random_weights(draft_config, seed=1).items()}
        for n in TP_SIZES:
            model = jax_port.load_model(config, tensors, dtype, tensor_parallel=n)
            draft = jax_port.load_model(draft_config, draft_tensors, dtype, tensor_parallel=n)
            for case in cases:
                mode, fields, with_draft = TP_CASES[case]
                generation = GenerationConfig(**fields)
                key = f"{family}/{case}/{n}"
                if mode == "speculative":
                    saved[f"{key}/tokens"] = jax_port.generate_speculative(
                        model, draft if with_draft else None, prompts, generation, 3
                    )[0]
                else:
                    saved[f"{key}/tokens"], saved[f"{key}/logits"] = jax_port.generate(
                        model, prompts, generation, mode, True
                    )

            # The cache a prefill leaves, made as port.generate makes the first case's (the same
            # settings, so the program it compiled serves this call too).
            @jax_port.exact
            def prefilled_cache(model=model):
                prompt = jax.device_put(np.asarray(prompts, np.int32), jax_port._inputs_sharding(model))
                with jax.default_device(jax_port._model_device(model)):
                    generation = GenerationConfig(**TP_CASES[cases[0]][1])
                    decoding, tokens = jax_generate.start_generation(prompt, generation, model.emb.embedding.dtype)
                    state, _ = jax_generate._start_cached(*split_model(model), prompt, tokens, decoding, True, True)
                return state.cache.keys

            for name, array in (("cache", prefilled_cache()), ("qkv", model.blocks[0].qkv.kernel[...])):
                spec = getattr(array.sharding, "spec", ())
                saved[f"{key.rsplit('/', 2)[0]}/{n}/{name}_spec"] = np.array(repr(tuple(spec)))
    np.savez(out, **saved)


COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")


def tensor_parallel_collectives(out: str) -> None:
    """How many of each collective the JAX port's compiled forward holds, split across 2 and 4
    devices: a prefill (T = 5) and a decode step (T = 1) through generate.py's `_forward`, for the
    gpt2 family (biases, GELU) and llama (SwiGLU, GQA: at N = 4 its 2 key/value heads are copied),
    read from XLA's compiled program and saved to `out` (.npz) by "family/N/T/collective"."""
    import re

    import jax

    from kvports.jax_impl import generate as jax_generate
    from kvports.jax_impl.model import init_cache
    from kvports.jax_impl.split import split_model

    jax_port = registry.load_port("jax")
    counts: dict[str, np.ndarray] = {}
    for family in ("gpt2", "llama"):
        config = TINY_FAMILIES[family]
        tensors = random_weights(config)
        for n in (2, 4):
            model = jax_port.load_model(config, tensors, "float32", tensor_parallel=n)
            for T in (5, 1):
                with jax.enable_x64(True):  # as the port runs it (jax_impl/port.py's exact)
                    tokens = jax.device_put(np.zeros((2, T), np.int32), model.emb.embedding[...].sharding)
                    cache = init_cache(model.config, 2, 8, np.float32)
                    compiled = jax_generate._forward.lower(*split_model(model), tokens, cache, None).compile()
                text = compiled.as_text()
                for name in COLLECTIVES:  # an op, not an operand's name (%all-reduce.3): a space before it
                    counts[f"{family}/{n}/{T}/{name}"] = np.array(len(re.findall(rf"\s{name}(?:-start)?\(", text)))
    np.savez(out, **counts)


def tensor_parallel_subprocess(out: Path, runs: dict[str, tuple[str, ...]]) -> dict[str, dict[str, np.ndarray]]:
    """`tensor_parallel_runs` for each dtype -> cases of `runs`, then `tensor_parallel_collectives`,
    one after the other in one fresh Python with 4 simulated CPU devices (one start, one import of
    JAX and torch); each dtype's arrays by key, and the collectives' under "collectives"."""
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"}
    paths = {dtype: f"{out}.{dtype}.npz" for dtype in runs}
    calls = [f"tensor_parallel_runs({paths[dtype]!r}, {dtype!r}, {cases!r})" for dtype, cases in runs.items()]
    paths["collectives"] = f"{out}.collectives.npz"
    calls.append(f"tensor_parallel_collectives({paths['collectives']!r})")
    code = f"from tests.helpers import tensor_parallel_collectives, tensor_parallel_runs; {'; '.join(calls)}"
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=root, timeout=900)
    arrays = {}
    for name, path in paths.items():
        with np.load(path) as saved:
            arrays[name] = {key: saved[key] for key in saved.files}
    return arrays
