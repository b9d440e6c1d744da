"""llama.cpp, through llama-cpp-python's low-level API: a peer the bench times beside the ports
(`kvports bench --peers`), on the GGUF file itself (in the file's own quantization) and on F16
and F32 GGUF files kvports writes from the same weights every port runs (kvports.formats.gguf.writer,
cached under $KVPORTS_HOME/gguf).

The model is loaded through `llama_model_load_from_file` rather than `Llama()`: the wheel's
native build crashes in its AMX weight-repacking path on some CPUs unless
`use_extra_bufts` is off, a field `Llama()` does not expose. Each generation clears the
context's memory, decodes the prompt in one batch, then one token at a time; the next token
is the argmax of the last logits (greedy, as every row), chosen here in NumPy.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from kvports.formats.gguf.reader import open_reader
from kvports.formats.gguf.writer import cached_gguf
from kvports.numpy_impl import port as numpy_port
from kvports.shared.config import ModelConfig

NAME = "llama.cpp"
MODES = ("cached",)
GGML_TYPE_F32 = 0  # ggml_type's value


@dataclass
class LlamaCppModel:
    model: Any  # llama_model_p
    context: Any  # llama_context_p
    n_vocab: int
    n_ctx: int
    weights: str  # the GGUF file's weight format: its matrices' most common type (Q4_1, F16, F32)
    log_callback: Any  # kept alive: llama.cpp calls it for as long as the library is loaded


def versions() -> dict[str, str]:
    return {"llama-cpp-python": llama_cpp.__version__}


@llama_cpp.llama_log_callback
def _quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp's loading chatter would fill the bench's terminal."""


def load_model(
    config: ModelConfig,
    tensors: dict[str, np.ndarray],
    dtype: str = "float32",
    device: str = "cpu",
    source: Path | None = None,
    threads: int | None = None,
    weights: str = "file",
    f32_attention: bool = False,
) -> LlamaCppModel:
    """The GGUF file `source` (the file `tensors` were read from) as llama.cpp loads it, or with weights
    "f16" / "f32" the GGUF file kvports writes from `tensors` with source's metadata; `threads` for its
    decode and its prompt batch. dtype is the file's own: llama.cpp computes on its quantized blocks."""
    if source is None or Path(source).suffix.lower() != ".gguf":
        raise ValueError("llama.cpp runs a GGUF file: give --weights FILE.gguf or --model smollm2")
    if device != "cpu":
        raise ValueError("llama.cpp's row runs on the CPU here")
    if weights != "file":
        source = cached_gguf(Path(source), config, tensors, weights)
    llama_cpp.llama_log_set(_quiet, ctypes.c_void_p())
    llama_cpp.llama_backend_init()
    model_params = llama_cpp.llama_model_default_params()
    model_params.use_extra_bufts = False  # the AMX repacking path crashes this wheel's build
    model_params.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(source).encode(), model_params)
    if not model:
        raise ValueError(f"llama.cpp could not load {source}")
    context_params = llama_cpp.llama_context_default_params()
    context_params.n_ctx = config.max_seq_len
    context_params.n_batch = config.max_seq_len  # the whole prompt in one decode: one-forward prefill
    context_params.n_ubatch = config.max_seq_len
    if f32_attention:
        context_params.type_k = context_params.type_v = GGML_TYPE_F32
        context_params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    if threads is not None:
        context_params.n_threads = context_params.n_threads_batch = threads
    context = llama_cpp.llama_init_from_model(model, context_params)
    if not context:
        llama_cpp.llama_model_free(model)
        raise ValueError("llama.cpp could not create a context")
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    if n_vocab != config.vocab_size:
        raise ValueError(f"llama.cpp reads a vocabulary of {n_vocab}, the bench's config {config.vocab_size}")
    return LlamaCppModel(model, context, n_vocab, llama_cpp.llama_n_ctx(context), weight_format(Path(source)), _quiet)


def weight_format(path: Path) -> str:
    """The most common type among the file's matrices (its norms are F32 whatever the format)."""
    reader = open_reader(path)
    kinds = Counter(tensor.tensor_type.name for tensor in reader.tensors if len(tensor.shape) > 1)
    return kinds.most_common(1)[0][0]


def decode_next(model: LlamaCppModel, tokens: list[int]) -> np.ndarray:
    """Feeds `tokens` after what the context holds; the last position's logits [V], a view of llama.cpp's buffer
    (valid until the next decode)."""
    array = (llama_cpp.llama_token * len(tokens))(*tokens)
    status = llama_cpp.llama_decode(model.context, llama_cpp.llama_batch_get_one(array, len(tokens)))
    if status != 0:
        raise RuntimeError(f"llama_decode returned {status}")
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(model.context, -1), shape=(model.n_vocab,))  # [V]


def generate(
    model: LlamaCppModel,
    prompts: np.ndarray,
    new_tokens: int,
    mode: str = "cached",
    return_logits: bool = False,
    on_token: Callable[[np.ndarray], None] | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Greedy: tokens [1, P + N] and, with return_logits, each step's logits [1, N, V] (float32, llama.cpp's
    own); on_token(token [1]) after each decode."""
    if mode not in MODES:
        raise ValueError(f"{NAME} has modes {MODES}, not {mode!r}")
    if prompts.shape[0] != 1:
        raise ValueError(f"{NAME}'s row decodes one sequence; --batch {prompts.shape[0]} is not timed")
    if prompts.shape[1] + new_tokens > model.n_ctx:
        raise ValueError(f"prompt + new tokens {prompts.shape[1] + new_tokens} exceed llama.cpp's n_ctx {model.n_ctx}")
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(model.context), True)
    chosen: list[int] = []
    steps: list[np.ndarray] = []
    feed = [int(token) for token in prompts[0]]
    for _ in range(new_tokens):
        logits = decode_next(model, feed)  # [V]
        token = int(np.argmax(logits))
        chosen.append(token)
        if return_logits:
            steps.append(logits.copy())
        if on_token is not None:
            on_token(np.array([token], dtype=np.int64))
        feed = [token]
    tokens = np.concatenate([prompts, np.array([chosen], dtype=np.int64)], axis=1)  # [1, P + N]
    return tokens, np.asarray(steps, np.float32).reshape(1, -1, model.n_vocab) if return_logits else None  # [1, N, V]


def synchronize(model: LlamaCppModel) -> None:
    llama_cpp.llama_synchronize(model.context)


matvec_seconds = numpy_port.matvec_seconds  # the bench's CPU roofline is NumPy's
