"""What the bench times: the three ports (naive, cached, and with --draft speculative), two
baselines, the optional torch.compile row and, with --peers, other engines (llama.cpp,
CTranslate2), each imported only when its rows run, and the note the table prints beside each."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import cast

from kvports import registry
from kvports.shared.contract import Timed

MODES = ("naive", "cached", "speculative")
DEFAULT_MODES = ("naive", "cached")  # speculative needs a draft: --modes ...,speculative --draft FILE|ngram


@dataclass(frozen=True)
class Runner:
    """One framework (or baseline) as the bench drives it."""

    framework: str  # what the JSON calls it
    module: str  # a port's or a baseline's module, imported when its rows run
    modes: tuple[str, ...]
    variant: str | None = None  # "torch.compile" for the optional compiled row
    compiles: bool = False  # the first call compiles: report first call minus steady state as compile_s
    peer: bool = False  # another engine (--peers): given the weights file and the thread count, its own cache
    options: tuple[tuple[str, str], ...] = ()  # more keyword arguments for its load_model

    @property
    def gpu(self) -> bool:
        """Runs on a GPU with --device gpu (NumPy and the peers stay on the CPU)."""
        return not self.peer and self.framework not in registry.CPU_ONLY

    @property
    def label(self) -> str:
        return self.framework if self.variant is None else f"{self.framework} ({self.variant})"

    @property
    def baseline(self) -> bool:
        """The seed's cache and transformers: PyTorch underneath, their caches grown step by step."""
        return self.framework in ("seed-concat", "transformers")

    @property
    def library(self) -> str:
        """Whose matrix-vector product measures this row's bandwidth."""
        if self.peer:
            return "numpy"  # no matrix-vector product of its own: the CPU's roofline is NumPy's
        return "torch" if self.baseline else self.framework


RUNNERS = (
    Runner("torch", "kvports.torch_impl.port", MODES),
    Runner("jax", "kvports.jax_impl.port", MODES, compiles="jax" in registry.COMPILES),
    Runner("numpy", "kvports.numpy_impl.port", MODES),
    Runner("seed-concat", "kvports.baselines.seed_concat", ("cached",)),
    Runner("transformers", "kvports.baselines.hf_transformers", ("cached",)),
)
COMPILED_RUNNER = Runner(
    "torch", "kvports.baselines.torch_compile", ("cached",), variant="torch.compile", compiles=True
)
FRAMEWORKS = tuple(runner.framework for runner in RUNNERS)
PEERS = "peers"
GROUPS = (*FRAMEWORKS, PEERS)  # what bench.rounds runs in a process of its own: a framework's rows, or the peers'
PEER_RUNNERS = (
    # The GGUF file's own quantization (its row's variant is the file's weight format), then F16 and F32
    # files kvports writes from the same weights.
    Runner("llama.cpp", "kvports.baselines.llama_cpp", ("cached",), peer=True),
    Runner("llama.cpp", "kvports.baselines.llama_cpp", ("cached",), "F16", peer=True, options=(("weights", "f16"),)),
    Runner("llama.cpp", "kvports.baselines.llama_cpp", ("cached",), "F32", peer=True, options=(("weights", "f32"),)),
    Runner(
        "ctranslate2",
        "kvports.baselines.ctranslate2",
        ("cached",),
        "float32",
        peer=True,
        options=(("compute_type", "float32"),),
    ),
    Runner(
        "ctranslate2",
        "kvports.baselines.ctranslate2",
        ("cached",),
        "int8",
        peer=True,
        options=(("compute_type", "int8"),),
    ),
)
PEERS_PACKAGES = {"llama.cpp": "llama_cpp", "ctranslate2": "ctranslate2"}  # the module each peer imports
PEERS_MISSING = (
    "not installed (pip install 'kvports[peers]'; llama-cpp-python builds from source, about 12 minutes on 2 cores)"
)

SPECULATIVE = (
    "draft-and-verify rounds (generate_speculative, --draft, K = --draft-tokens): its tokens reach the host a "
    "round at a time, so decode is the mean ms per token after the first; vs cached compares total times"
)
PREALLOCATED = (
    "writes each step's k and v in place into a cache preallocated for P + N positions and attends over the "
    "slots filled so far (no copy of the history, no mask for a plain decode step)"
)
STATIC_SLOTS = (
    "attends over all P + N preallocated slots (static shapes under jit), the empty ones masked: its "
    "per-step cost is set by P + N, not the position"
)
NOTES = {
    ("jax", "naive"): "every step, streamed or in generate()'s compiled loop, recomputes the whole fixed [B, P + N] "
    "buffer (one compile; the causal mask hides the unfilled tail), so its per-step cost is set by P + N, not the "
    "position",
    ("jax", "cached"): STATIC_SLOTS
    + "; per-step times are the jitted prefill, then one compiled call per step (forward and "
    "choice of the next token); "
    "total_s is the compiled loop (steady state); compile_s = first call minus steady state",
    ("torch", "cached"): PREALLOCATED,
    ("numpy", "cached"): PREALLOCATED,
    ("seed-concat", "cached"): "the seed's cache: torch.cat copies the whole history and triu rebuilds the mask "
    "every step",
    ("transformers", "cached"): "the family's own transformers class (GPT2LMHeadModel, LlamaForCausalLM, "
    "MistralForCausalLM), generate(do_sample=False) on the same weights; per-step times from its streamer",
    ("torch", "speculative"): SPECULATIVE,
    ("numpy", "speculative"): SPECULATIVE,
    ("jax", "speculative"): "draft-and-verify rounds in one compiled lax.while_loop: its tokens reach the host only "
    "when it returns, so only total time per token is measured; vs cached compares total times",
}
COMPILED_NOTE = (
    "torch.compile of the torch port's forward at the row's weight format (on the CPU with inductor's freezing and "
    "max-autotune over its own C++ GEMM); compile_s = first call minus steady state"
)
CTRANSLATE2_NOTE = (
    "CTranslate2's Generator.generate_tokens on kvports' Hugging Face export of the same weights, converted by "
    "TransformersConverter, intra_threads = the bench's thread count; int8 is quantized as it loads"
)
LLAMA_CPP_WRITTEN = (
    "llama.cpp as above, on a GGUF file kvports writes from the weights every port runs (the source file's "
    "metadata and tokenizer, llama.cpp's names and q/k row order; norms F32), cached under $KVPORTS_HOME/gguf"
)
NOTES.update(
    {
        ("torch (torch.compile)", "cached"): COMPILED_NOTE,
        ("llama.cpp", "cached"): "llama.cpp (llama-cpp-python's low-level API) on the GGUF file itself, in its own "
        "quantization: the prompt in one llama_decode, then one per token, argmax of its logits; n_threads = the "
        "bench's thread count; its f16 cache is its own (KV cache not counted)",
        ("llama.cpp (F16)", "cached"): LLAMA_CPP_WRITTEN,
        ("llama.cpp (F32)", "cached"): LLAMA_CPP_WRITTEN,
        ("ctranslate2 (float32)", "cached"): CTRANSLATE2_NOTE,
        ("ctranslate2 (int8)", "cached"): CTRANSLATE2_NOTE,
    }
)


def note(runner: Runner, mode: str) -> str | None:
    return NOTES.get((runner.label, mode))


def import_runner(runner: Runner) -> tuple[Timed | None, str | None]:
    """The runner's module, or the reason it cannot run."""
    if runner.peer and importlib.util.find_spec(PEERS_PACKAGES[runner.framework]) is None:
        return None, PEERS_MISSING
    try:
        if runner.module.endswith(".port") and runner.variant is None:
            return registry.load_port(runner.framework), None
        return cast(Timed, importlib.import_module(runner.module)), None
    except registry.PortUnavailable as exc:
        return None, exc.reason
    except ModuleNotFoundError as exc:
        # A baseline whose library is not installed is a row that says so; any other import failure is a bug.
        if exc.name is None or importlib.util.find_spec(exc.name.split(".")[0]) is not None:
            raise
        return None, f"not installed ({exc})"


def group_of(runner: Runner) -> str:
    """The process a runner's rows share under bench.rounds: its framework's (the compiled row is torch's), or
    the peers'. Each framework alone in a process, as it runs for a user: one left in a process after
    another's rows was measured slower there (JAX's prefill at 0.6x of its own, after torch's six formats)."""
    return PEERS if runner.peer else runner.framework
