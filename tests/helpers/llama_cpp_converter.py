"""llama.cpp's own convert_hf_to_gguf.py, the way users make GGUF files: taken out of
llama-cpp-python's source distribution (it ships under vendor/llama.cpp/, beside its gguf-py) by
`pip download`, kept under $KVPORTS_HOME across runs. Only the converter, its `conversion`
package and gguf-py are extracted; nothing of llama.cpp is committed here."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from kvports.hub import home

# The converter as it ships, with one patch: its BPE pre-tokenizer check (a hash of a fixed text's
# token ids, which no tiny test vocabulary matches) answers "default". Tensors and metadata are untouched.
# It runs once per (model folder, file) pair of its arguments, all in one interpreter: each process
# of its own imported torch and transformers again (seconds each).
RUNNER = """
import runpy, sys
root, jobs = sys.argv[1], sys.argv[2:]
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
for directory, out in zip(jobs[::2], jobs[1::2]):
    sys.argv = ["convert_hf_to_gguf.py", directory, "--outfile", out, "--outtype", "f32"]
    runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""
WANTED = ("/vendor/llama.cpp/convert_hf_to_gguf.py", "/vendor/llama.cpp/conversion/", "/vendor/llama.cpp/gguf-py/")


def converter_root() -> Path:
    """The folder holding convert_hf_to_gguf.py (fetched once); OSError or CalledProcessError if it cannot be."""
    root = home() / "llama.cpp-converter"
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "llama-cpp-python"]
            + ["-d", scratch],
            check=True,
            capture_output=True,
            timeout=900,
        )
        (archive,) = Path(scratch).glob("llama_cpp_python-*.tar.gz")
        staging = Path(scratch) / "out"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and any(w in m.name for w in WANTED)]
            tar.extractall(staging, members=members, filter="data")
        (source,) = staging.glob("*/vendor/llama.cpp")
        root.parent.mkdir(parents=True, exist_ok=True)
        source.rename(root)  # one rename: a run killed halfway leaves no half folder
    return root


def write_tokenizer(directory: Path, vocab_size: int, model_type: str) -> None:
    """A byte-pair tokenizer of the model's vocabulary ("a", "b", "ab", then w3, w4, ...), which the converter
    writes into the file. One merge ("a" "b"): llama.cpp refuses a BPE ("gpt2") vocabulary that has no merges
    key, and its converter writes none for an empty list. Qwen2's tokenizer class adds <|endoftext|> after
    it: one word fewer leaves it room. A Phi-3 vocabulary holds Phi-3's special tokens, which llama.cpp
    looks up by name in a file whose model name says phi3."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from tokenizers.pre_tokenizers import Whitespace

    words = vocab_size - (model_type == "qwen2")
    special = ["<unk>", "<s>", "</s>", "<|endoftext|>"] if model_type == "phi3" else []
    texts = ["a", "b", "ab", *special, *(f"w{i}" for i in range(3 + len(special), words))]
    vocab = {text: i for i, text in enumerate(texts)}
    tokenizer = Tokenizer(BPE(vocab, [("a", "b")], unk_token="a"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    # Phi-3's converter takes the GPT-2 path for this class name only (it reads tokenizer.model otherwise).
    kind = "GPT2Tokenizer" if model_type == "phi3" else "PreTrainedTokenizerFast"
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": kind}))


def convert(root: Path, jobs: list[tuple[Path, Path]]) -> None:
    """Each (directory, out) of jobs: directory (a saved transformers model with its tokenizer) -> out, a
    float32 GGUF file; one process converts them all."""
    command = [sys.executable, "-c", RUNNER, str(root), *(str(path) for job in jobs for path in job)]
    subprocess.run(command, check=True, capture_output=True, timeout=600)
