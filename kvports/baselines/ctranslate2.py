"""CTranslate2, a peer the bench times beside the ports (`kvports bench --peers`): the weights
written as a Hugging Face directory by kvports' own exporter (kvports.formats.hf.exporter.export_hf),
converted by `ctranslate2.converters.TransformersConverter`, loaded at compute type float32
or int8 (quantized as it loads), and run greedily by `Generator.generate_tokens`.

The bench's prompts are token ids, so the converter is handed a vocabulary of the ids
themselves (token i spelled "i"), not a text tokenizer: nothing is tokenized twice.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ctranslate2
import numpy as np

from kvports.formats.hf.exporter import export_hf
from kvports.numpy_impl import port as numpy_port
from kvports.shared.config import ModelConfig

NAME = "ctranslate2"
MODES = ("cached",)
COMPUTE_TYPES = ("float32", "int8")


class IdVocabulary:
    """What the converter reads of a tokenizer: the vocabulary (id i spelled str(i)) and its special tokens.
    No end token stops a row: generate passes end_token=[]."""

    def __init__(self, size: int):
        self.vocab = {str(i): i for i in range(size)}
        self.bos_token = self.eos_token = self.unk_token = "0"
        self.pad_token = None

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def __len__(self) -> int:
        return len(self.vocab)


class IdsConverter(ctranslate2.converters.TransformersConverter):
    def __init__(self, directory: str, vocab_size: int):
        super().__init__(directory)
        self.vocab_size = vocab_size

    def load_tokenizer(self, tokenizer_class: Any, model_name_or_path: str, **kwargs: Any) -> IdVocabulary:
        return IdVocabulary(self.vocab_size)


@dataclass
class CTranslate2Model:
    generator: Any  # ctranslate2.Generator
    compute_type: str

    @property
    def weights(self) -> str:
        """The weight format the bench reports: the compute type the weights were loaded at."""
        return self.compute_type


def versions() -> dict[str, str]:
    return {"ctranslate2": ctranslate2.__version__}


def load_model(
    config: ModelConfig,
    tensors: dict[str, np.ndarray],
    dtype: str = "float32",
    device: str = "cpu",
    source: Path | None = None,
    threads: int | None = None,
    compute_type: str = "float32",
) -> CTranslate2Model:
    """The tensors exported, converted and loaded at `compute_type` with `threads` intra-op threads. source
    (the weights file) is not read: the converter starts from the same tensors every port runs."""
    if compute_type not in COMPUTE_TYPES:
        raise ValueError(f"compute_type {compute_type!r} is not one of {COMPUTE_TYPES}")
    if device != "cpu":
        raise ValueError("ctranslate2's rows run on the CPU here")
    float32 = {name: array.astype(np.float32, copy=False) for name, array in tensors.items()}
    with tempfile.TemporaryDirectory(prefix="kvports-ct2-") as folder:
        hf, converted = Path(folder) / "hf", Path(folder) / "ct2"
        export_hf(config, float32, hf)
        IdsConverter(str(hf), config.vocab_size).convert(str(converted))
        generator = ctranslate2.Generator(
            str(converted), device="cpu", compute_type=compute_type, intra_threads=threads or 0, inter_threads=1
        )
    return CTranslate2Model(generator, compute_type)


def generate(
    model: CTranslate2Model,
    prompts: np.ndarray,
    new_tokens: int,
    mode: str = "cached",
    return_logits: bool = False,
    on_token: Callable[[np.ndarray], None] | None = None,
) -> tuple[np.ndarray, None]:
    """Greedy (sampling_topk=1), no end token: tokens [1, P + N] and no logits; on_token(token [1]) as
    generate_tokens yields each step."""
    if mode not in MODES:
        raise ValueError(f"{NAME} has modes {MODES}, not {mode!r}")
    if prompts.shape[0] != 1:
        raise ValueError(f"{NAME}'s generate_tokens decodes one sequence; --batch {prompts.shape[0]} is not timed")
    chosen: list[int] = []
    steps = model.generator.generate_tokens(
        [str(int(token)) for token in prompts[0]], max_length=new_tokens, sampling_topk=1, end_token=[]
    )
    for step in steps:
        chosen.append(int(step.token_id))
        if on_token is not None:
            on_token(np.array([step.token_id], dtype=np.int64))
        if len(chosen) == new_tokens:
            break
    if len(chosen) != new_tokens:
        raise RuntimeError(f"{NAME} generated {len(chosen)} tokens, not {new_tokens}")
    return np.concatenate([prompts, np.array([chosen], dtype=np.int64)], axis=1), None  # [1, P + N]


def synchronize(model: CTranslate2Model) -> None:
    pass  # generate_tokens returns once its last step is on the host


matvec_seconds = numpy_port.matvec_seconds  # the bench's CPU roofline is NumPy's
