"""What a port must provide, and what `kvports bench` needs of anything it times.

A port is a module (`kvports.torch_impl.port`, `kvports.jax_impl.port`,
`kvports.numpy_impl.port`) whose names match `Port`; a baseline
(`kvports.baselines.*`) is a module whose names match `Baseline`. Everything crosses
these calls as NumPy: prompts `[B, P]` int64 in; tokens `[B, P + N]` int64 and step
logits `[B, N, V]` out. Inputs are checked before they get here (`shared.checks`): a
port never sees an out-of-range id, an empty prompt or a length past `max_seq_len`.

tests/structure/test_contract.py checks every importable port and baseline against these
classes (names present, parameters named and ordered as here, the same defaults), and
docs/PORTS.md's tables are rendered from them (`python tools/ports_doc.py`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol

import numpy as np

from kvports.shared.config import ModelConfig
from kvports.shared.generation import GenerationConfig, RowSampling

Model = Any  # each framework's own model object; only its port looks inside
OnToken = Callable[[np.ndarray], None]  # called with the new token of every row, [B] int64


class Timed(Protocol):
    """What `kvports bench` calls of anything it times: a port or a baseline."""

    NAME: str  # a port's framework ("torch", "jax", "numpy"); a baseline's own name ("seed-concat", ...)

    def versions(self) -> dict[str, str]:
        """`{library: version}` of what this module runs on."""
        ...

    def load_model(
        self, config: ModelConfig, tensors: dict[str, np.ndarray], dtype: str = "float32", device: str = "cpu"
    ) -> Model:
        """A model from `kvports.formats.weights.load_weights`' tensors (the seed's names, Linear weights `(out, in)`);
        dtype `"float32"` or `"float64"`; device `"cpu"` or `"gpu"`."""
        ...

    def generate(
        self,
        model: Model,
        prompts: np.ndarray,
        new_tokens: int,
        mode: str,
        return_logits: bool = False,
        *,
        on_token: OnToken | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Greedy generation: `(tokens [B, P + N], step logits [B, N, V] or None)`. `on_token(token [B])` is
        called as each new token reaches the host (the first call after the prefill), so the bench can time
        every step."""
        ...

    def synchronize(self, model: Model) -> None:
        """Waits until the device has finished the work queued so far (timing)."""
        ...

    def matvec_seconds(self, rows: int, cols: int, repeats: int, device: str = "cpu") -> list[float]:
        """Seconds for each of `repeats` float32 products `[rows, cols] @ [cols]` after an untimed one: the
        streaming bandwidth the bench's roofline divides by."""
        ...


class Port(Timed, Protocol):
    """One framework's model behind NumPy in, NumPy out: what the command line, the tests and the bench call."""

    def resolve_device(self, device: str) -> Any:
        """`"cpu"` or `"gpu"` -> the framework's device object; a GPU the machine lacks is an error."""
        ...

    def device_count(self, device: str) -> int | None:
        """How many devices of `device`'s kind a model can be split across (`tensor_parallel`); None: no
        bound (torch on the CPU runs a process per shard)."""
        ...

    def load_model(
        self,
        config: ModelConfig,
        tensors: dict[str, np.ndarray],
        dtype: str = "float32",
        device: str = "cpu",
        *,
        quant: str = "none",
        tensor_parallel: int = 1,
    ) -> Model:
        """`Timed.load_model`, and dtype `"bfloat16"` (float32 tensors, cast; norms and softmax accumulate in
        float32) and quant `"int8"` (per output channel, at load) or `"q4"` (a GGUF's own 4-bit blocks beside the
        dequantized tensors, `shared.quantization.q4_names`) where `kvports.validation.PRECISIONS` lists them; elsewhere
        they are refused before this is called. Split Megatron-style across `tensor_parallel` devices (checked
        beforehand by `checks.check_tensor_parallel`; NumPy: 1 only)."""
        ...

    def linear_route(self, dtype: str, quant: str, device: str) -> str:
        """The kernel a model loaded at this dtype, quant and device takes for its linears, in one word
        (kvports generate's header, the bench's row): where a CPU-specific route needs instructions the
        CPU lacks (shared.cpu), the model takes a plain one, and this says which."""
        ...

    def generate(
        self,
        model: Model,
        prompts: np.ndarray,
        generation: int | GenerationConfig,
        mode: str,
        return_logits: bool = False,
        prefill: bool = True,
        on_token: OnToken | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Generation, mode `"naive"` (the whole history every step) or `"cached"` (a KV cache). prompts `[B, P]`,
        `PAD` (-1) on the left of shorter rows; generation a `GenerationConfig` (sampling, seed, stop ids) or a
        number of greedy tokens. `(tokens [B, P + N], PAD after a row stops; step logits [B, steps, V] or None)`.
        `prefill=False` feeds the prompt token by token (pitfall 2); `on_token(token [B])` is called as each new
        token reaches the host."""
        ...

    def generate_speculative(
        self,
        model: Model,
        draft: Model | None,
        prompts: np.ndarray,
        generation: int | GenerationConfig,
        draft_tokens: int,
        ngram: int = 2,
        on_token: OnToken | None = None,
    ) -> tuple[np.ndarray, dict[str, int]]:
        """The target's own tokens `[B, P + N]` from rounds in which a draft (a model loaded by `load_model` with
        the same vocabulary, or None: prompt lookup of `ngram`-grams) proposes `draft_tokens` tokens and one
        target forward verifies them; and the counts `rounds`, `target_forwards`, `proposed`, `accepted`."""
        ...

    def forward_chunks(self, model: Model, tokens: np.ndarray, chunk_sizes: Sequence[int]) -> np.ndarray:
        """Feeds `tokens [B, T]` into one cache chunk by chunk; the logits `[B, T, V]` (chunked prefill equals
        one token at a time). Chunk sizes that do not add up to T are a `UserError` (`checks.check_chunk_sizes`)."""
        ...

    def clear_compiled(self) -> None:
        """Forgets compiled programs (JAX), so a patched function is traced again; a no-op elsewhere."""
        ...

    # Continuous batching (kvports/batching's engine; docs/BATCHING.md): a pool of KV blocks and one step of
    # the running batch over it.

    def init_block_pool(self, model: Any, num_blocks: int, block_size: int, max_batch: int, max_blocks: int) -> Any:
        """The KV pool: keys and values `[L, num_blocks, block_size, Hkv, Dh]`, blocks shared by every running
        sequence. `max_batch` rows and `max_blocks` blocks a row fix JAX's step shapes; the eager ports take
        each step's own."""
        ...

    def paged_step(
        self,
        model: Any,
        pool: Any,
        tokens: np.ndarray,
        start: np.ndarray,
        block_tables: np.ndarray,
        sampling: RowSampling,
        logprobs: int | None = None,
        every_position: bool = False,
    ) -> tuple[np.ndarray, Any, tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
        """One step of a running batch over the pool: `tokens [B, T]` (PAD on the left of shorter rows) after
        each row's `start [B]` tokens in the pool, `block_tables [B, M]` (-1 past a row's blocks), each row's
        temperature, top-k, top-p and draw (`RowSampling`, arrays `[B]`: one compiled program serves any
        values). Each row's next token `[B]` (greedy at temperature 0; PAD where its logits held an inf or a
        NaN), the pool for the next step (JAX donates the one passed in), and with `logprobs` K (not None)
        the chosen tokens' log-probabilities `[B]` and the K likeliest ids and their log-probabilities
        `[B, K]` (log-softmax of the raw logits, before temperature, top-k and top-p:
        `shared.generation.token_logprobs`, on the host, from the step's logits `paged.py` returns), else None;
        `every_position`: every position's, `[B, T]` and `[B, T, K]`, position t scoring the token at
        t + 1 and the last the new token (a prompt's own log-probabilities)."""
        ...

    def compile_paged_steps(
        self,
        model: Any,
        pool: Any,
        max_step_tokens: int,
        longest: int,
        on_compiled: Callable[[int, int], None] | None = None,
    ) -> int:
        """Compiles, before a server serves, every program a `paged_step` can need: for each step the
        scheduler can make (B rows x T tokens within `max_step_tokens`, or one prompt up to `longest`),
        the forward of each (rows, chunk width) the port runs it in, with the last position's logits and
        with every position's, and the row sampling of each row count with and without an `allowed`
        mask (JAX); how many programs: a fixed few, whatever `longest`; `on_compiled(done, total)`
        after each program. The eager ports: 0."""
        ...


class Baseline(Timed, Protocol):
    """A baseline the bench times beside the ports (the seed's concat cache, transformers' GPT-2)."""

    MODES: tuple[str, ...]  # the modes its generate runs, e.g. ("cached",)


# ---------------------------------------------------------------- checking a module against a protocol


def members(protocol: type) -> dict[str, inspect.Signature | None]:
    """The protocol's names in definition order, base classes first: a signature for each call
    (without `self`), None for each data attribute."""
    found: dict[str, inspect.Signature | None] = {}
    for cls in reversed(protocol.__mro__):
        if cls in (object, Protocol, Generic):
            continue
        for name in cls.__dict__.get("__annotations__", {}):
            found.setdefault(name, None)
        for name, value in cls.__dict__.items():
            if inspect.isfunction(value) and not name.startswith("_"):
                signature = inspect.signature(value)
                found[name] = signature.replace(parameters=list(signature.parameters.values())[1:])
    return found


def mismatches(module: object, protocol: type) -> list[str]:
    """How `module` falls short of `protocol`: missing names, and calls a caller of the protocol could not
    make (a parameter renamed, moved, missing, without the protocol's default, or an extra one without a
    default). Empty when it conforms. Types are not compared: the tests check the values."""
    label = getattr(module, "__name__", repr(module))
    problems = []
    for name, wanted in members(protocol).items():
        if not hasattr(module, name):
            problems.append(f"{label} has no {name}")
        elif wanted is not None:
            value = getattr(module, name)
            if not callable(value):
                problems.append(f"{label}.{name} is not callable")
                continue
            problems += [f"{label}.{name}: {why}" for why in _call_mismatches(wanted, inspect.signature(value))]
    return problems


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _call_mismatches(wanted: inspect.Signature, actual: inspect.Signature) -> list[str]:
    problems = []
    actual_params = [p for p in actual.parameters.values() if p.kind not in _VARIADIC]
    actual_positional = [p for p in actual_params if p.kind in _POSITIONAL]
    by_name = {p.name: p for p in actual_params}
    used: set[str] = set()
    for index, param in enumerate(wanted.parameters.values()):
        if param.kind in _POSITIONAL:
            # A caller may pass it by position: the same name must sit at the same place.
            if index >= len(actual_positional) or actual_positional[index].name != param.name:
                found = [p.name for p in actual_positional]
                problems.append(f"parameter {index + 1} must be {param.name!r} (found {found})")
                if index < len(actual_positional):
                    used.add(actual_positional[index].name)  # reported once, here
                continue
            mine = actual_positional[index]
        else:
            keyword = by_name.get(param.name)
            if keyword is None or keyword.kind == inspect.Parameter.POSITIONAL_ONLY:
                problems.append(f"has no keyword parameter {param.name!r}")
                continue
            mine = keyword
        used.add(mine.name)
        if param.default is not inspect.Parameter.empty and mine.default != param.default:
            problems.append(
                f"{param.name} must default to {param.default!r} (found "
                f"{'no default' if mine.default is inspect.Parameter.empty else repr(mine.default)})"
            )
    for param in actual_params:
        if param.name not in used and param.default is inspect.Parameter.empty:
            problems.append(f"extra parameter {param.name!r} needs a default: the protocol's callers never pass it")
    return problems
