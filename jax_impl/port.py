"""What the command line, the tests and the benchmark call: NumPy in, NumPy out.
The same names in every port (the contract: docs/PORTS.md); only the framework calls differ."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import flax
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from flax import nnx

from kvports.jax_impl import bandwidth, paged, speculative
from kvports.jax_impl.fast.layout import lay_out
from kvports.jax_impl.fast.quant import quantize_model
from kvports.jax_impl.fast.row_loop import by_rows, row_threads
from kvports.jax_impl.generate import generate_cached, generate_naive
from kvports.jax_impl.generate import prefill as prefill_step
from kvports.jax_impl.model import TinyModel, init_cache
from kvports.shared.capabilities import refusal
from kvports.shared.checks import check_chunk_sizes
from kvports.shared.config import ModelConfig
from kvports.shared.generation import GenerationConfig, RowSampling, as_generation, step_logprobs
from kvports.shared.quantization import float_tensors

NAME = "jax"
JAX_DTYPES = {"float32": jnp.float32, "float64": jnp.float64, "bfloat16": jnp.bfloat16}

Params = ParamSpec("Params")
Result = TypeVar("Result")


def exact(function: Callable[Params, Result]) -> Callable[Params, Result]:
    """Run a port call in JAX's x64 mode, with float32 matmuls in float32 (no TF32 on a GPU).
    float64 must be real float64 (JAX silently truncates to float32 otherwise), and a float32
    run needs it too: its RoPE tables and sampling probabilities are float64, as the reference
    computes them. Scoped to the port's calls, not set for the process at import: both settings
    are part of jit's cache key, so programs traced under them never serve a call without them,
    and every int array the ports make pins its dtype (int32), so none changes with the mode."""

    @functools.wraps(function)
    def scoped(*args: Params.args, **kwargs: Params.kwargs) -> Result:
        with jax.enable_x64(True), jax.default_matmul_precision("highest"):
            return function(*args, **kwargs)

    return scoped


# XLA:CPU links each compiled kernel into pages of its own: three memory mappings a kernel, about
# 1,500 for one SmolLM2 prompt length (its prefill and decode loop, a program each), and JAX's
# in-memory cache keeps every program for good. Linux refuses a process more mappings than
# vm.max_map_count (65,530 by default): a process that had generated from ~40 prompt lengths died
# (LLVM's "Cannot allocate memory", then a segfault). Once a call finds the process past half the
# limit it drops every compiled program first; the next calls load theirs again from the disk cache
# (~1.5 s for SmolLM2's two). Counting the mappings reads /proc/self/maps (~1 ms a thousand), so a
# call counts them only when a program was compiled or loaded since the last count.
COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_retrieval_time_sec")
PROGRAMS_SINCE_COUNT = [0]
PROGRAMS_LOCK = threading.Lock()


def _count_programs(event: str, duration: float, **kwargs: Any) -> None:
    if event in COMPILE_EVENTS:
        PROGRAMS_SINCE_COUNT[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_programs)


def map_limit() -> int | None:
    """The most memory mappings Linux allows a process (None: not Linux, or not readable)."""
    try:
        with open("/proc/sys/vm/max_map_count", "rb") as limit:
            return int(limit.read(32))
    except (OSError, ValueError):
        return None


def mappings() -> int:
    with open("/proc/self/maps", "rb") as maps:
        return maps.read().count(b"\n")


def make_room_for_programs() -> bool:
    """Drop every compiled program if the process holds more than half the mappings it may; True if so."""
    with PROGRAMS_LOCK:
        if not PROGRAMS_SINCE_COUNT[0]:
            return False
        PROGRAMS_SINCE_COUNT[0] = 0
        limit = map_limit()
        if limit is None or mappings() <= limit // 2:
            return False
        jax.clear_caches()
        return True


def versions() -> dict[str, str]:
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__}


def resolve_device(device: str) -> jax.Device:
    # exact() pins float32 matmuls to "highest" precision for every call: no TF32 on a GPU.
    if device == "gpu":
        try:
            return jax.devices("gpu")[0]
        except RuntimeError:
            platforms = sorted({found.platform for found in jax.devices()})
            raise RuntimeError(
                f"jax {jax.__version__} finds no GPU (platforms: {', '.join(platforms)}; a CUDA build is jax[cuda13])"
            ) from None
    return jax.devices("cpu")[0]


def device_count(device: str) -> int | None:
    """The devices a model can be split across: JAX's of that platform (on the CPU, the simulated
    devices it started with)."""
    try:
        return len(jax.devices(device))
    except RuntimeError:  # no such platform here
        return 0


def _parameter_slots(model: TinyModel) -> dict[str, tuple[nnx.Variable, bool]]:
    """Every torch state_dict name -> (the nnx parameter it fills, transpose?).
    nnx.Linear keeps its kernel (in, out), the transpose of torch's (out, in) weight;
    nnx.LayerNorm calls its weight `scale`."""
    config = model.config
    slots: dict[str, tuple[nnx.Variable, bool]] = {"emb.weight": (model.emb.embedding, False)}
    if config.positions == "learned":
        slots["pos.weight"] = (model.pos.embedding, False)

    def norm(prefix: str, module: nnx.Module) -> None:
        if config.norm == "layernorm":
            slots[f"{prefix}.weight"] = (module.scale, False)
            slots[f"{prefix}.bias"] = (module.bias, False)
        else:
            slots[f"{prefix}.weight"] = (module.weight, False)

    def linear(prefix: str, module: nnx.Linear) -> None:
        slots[f"{prefix}.weight"] = (module.kernel, True)
        if module.bias is not None:
            slots[f"{prefix}.bias"] = (module.bias, False)

    for i, block in enumerate(model.blocks):
        norm(f"blocks.{i}.ln1", block.ln1)
        norm(f"blocks.{i}.ln2", block.ln2)
        linear(f"blocks.{i}.qkv", block.qkv)
        linear(f"blocks.{i}.proj", block.proj)
        linear(f"blocks.{i}.ffn.0", getattr(block.ffn, "0"))
        linear(f"blocks.{i}.ffn.2", getattr(block.ffn, "2"))
        if config.qk_norm:
            slots[f"blocks.{i}.q_norm.weight"] = (block.q_norm.weight, False)
            slots[f"blocks.{i}.k_norm.weight"] = (block.k_norm.weight, False)
        if config.post_norms:
            norm(f"blocks.{i}.ln1_post", block.ln1_post)
            norm(f"blocks.{i}.ln2_post", block.ln2_post)
    norm("ln", model.ln)
    if not config.tie_embeddings:
        linear("head", model.head)
    return slots


def as_host(logits: jax.Array) -> np.ndarray:
    """Logits as NumPy: bfloat16's as float32 (as torch's port returns them), float64's as they are."""
    return np.asarray(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)))


def shapes_only(config: ModelConfig, dtype: jnp.dtype) -> TinyModel:
    """The model with its parameters' shapes and dtypes but no values: nnx.eval_shape traces the
    constructor instead of drawing every initial weight (one compile and run per shape, about 5 s
    of SmolLM2's load). Dropout's random stream gets a concrete key: eval mode never draws from it."""
    model = nnx.eval_shape(lambda: TinyModel(config, dtype=dtype, rngs=nnx.Rngs(0)))
    for _, variable in nnx.iter_graph(model):
        if isinstance(variable, nnx.RngKey):
            variable.set_value(jax.random.key(0))
        elif isinstance(variable, nnx.RngCount):
            variable.set_value(jnp.zeros((), jnp.uint32))
    return model


@exact
def load_model(
    config: ModelConfig,
    tensors: dict[str, np.ndarray],
    dtype: str = "float32",
    device: str = "cpu",
    *,
    quant: str = "none",
    tensor_parallel: int = 1,
) -> TinyModel:
    # What shared/capabilities.py says this port loads (the application's rules refused the rest first).
    assert refusal("jax", dtype, quant, tensor_parallel) is None, refusal("jax", dtype, quant, tensor_parallel)
    config = config.for_compute()  # a window wider than max_seq_len, narrowed: JAX's int32 masks stay exact
    target = resolve_device(device)
    placement: Callable[[str], jax.Device | jax.sharding.Sharding] = lambda name: target  # noqa: E731
    if tensor_parallel > 1:  # split across devices: the layout and each parameter's sharding (fast/parallel.py)
        from kvports.jax_impl.fast import parallel

        config, tensors, placement = parallel.split_model(config, tensors, target.platform, tensor_parallel)
    with jax.default_device(target):
        model = shapes_only(config, JAX_DTYPES[dtype])  # every parameter is set from the file below
    if tensor_parallel > 1:
        model = parallel.regroup_fused(model, tensor_parallel)  # the fused products read their shard-major kernels
    slots = _parameter_slots(model)
    weights = float_tensors(tensors)
    assert set(slots) == set(weights), f"names differ: {sorted(set(slots) ^ set(weights))}"
    for name, (variable, transpose) in slots.items():
        array = weights[name].T if transpose else weights[name]
        assert tuple(variable.shape) == array.shape, f"{name}: file {array.shape}, model {tuple(variable.shape)}"
        variable.set_value(jax.device_put(np.ascontiguousarray(array, dtype=JAX_DTYPES[dtype]), placement(name)))
    n_params = len(jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n_params == len(slots), f"model has {n_params} parameters, the file fills {len(slots)}"
    # The Linear layers swapped: quantized (fast/quant.py), bfloat16 in the layout XLA's CPU dot is fast in
    # (fast/layout.py), or float32 by rows for the row loop at --threads (fast/row_loop.py). Not under tensor
    # parallelism, whose shardings name nnx's kernels (quant is refused there).
    with jax.default_device(target):
        if quant != "none":
            model = quantize_model(model, tensors, quant, JAX_DTYPES[dtype])
        elif dtype == "bfloat16" and tensor_parallel == 1:
            model = lay_out(model, tensors, JAX_DTYPES[dtype])
        elif dtype == "float32" and tensor_parallel == 1 and target.platform == "cpu" and row_threads():
            model = by_rows(model, tensors)  # --threads: a decode step's products run the row loop
    model.eval()  # nnx's eval() sets dropout off in place and returns None
    return model


def linear_route(dtype: str, quant: str, device: str) -> str:
    # XLA compiles every dot for the CPU (or GPU) it finds; at --threads a float32 decode step's run row_loop.py's loop
    return "loop+xla" if dtype == "float32" and quant == "none" and device == "cpu" and row_threads() else "xla"


def _model_device(model: TinyModel) -> jax.Device:
    return next(iter(model.emb.embedding[...].devices()))


def _inputs_sharding(model: TinyModel) -> jax.sharding.Sharding:
    # Where a call's inputs go: the embedding's placement, one device or every device of a split
    # model (replicated there), so jit never sees arrays committed to different devices.
    return model.emb.embedding[...].sharding


@exact
def generate(
    model: TinyModel,
    prompts: np.ndarray,
    generation: int | GenerationConfig,
    mode: str,
    return_logits: bool = False,
    prefill: bool = True,
    on_token: Callable[[np.ndarray], None] | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """prompts [B, P] (PAD on the left of shorter rows) -> tokens [B, P + N] (PAD after a row
    stops) and step logits [B, steps, V]; on_token(token [B]) as each token reaches the host.
    generation: a GenerationConfig, or a number of greedy tokens."""
    make_room_for_programs()
    prompt = jax.device_put(np.asarray(prompts, dtype=np.int32), _inputs_sharding(model))  # [B, P]
    to_host = None if on_token is None else (lambda token: on_token(token.astype(np.int64)))
    with jax.default_device(_model_device(model)):
        if mode == "cached":
            tokens, logits = generate_cached(model, prompt, as_generation(generation), return_logits, prefill, to_host)
        else:
            tokens, logits = generate_naive(model, prompt, as_generation(generation), return_logits, to_host)
    # [B, P + N], [B, steps, V]
    return np.asarray(tokens, dtype=np.int64), None if logits is None else as_host(logits)


@exact
def generate_speculative(
    model: TinyModel,
    draft: TinyModel | None,
    prompts: np.ndarray,
    generation: int | GenerationConfig,
    draft_tokens: int,
    ngram: int = 2,
    on_token: Callable[[np.ndarray], None] | None = None,
) -> tuple[np.ndarray, dict[str, int]]:
    """The target's own tokens [B, P + N] from draft-and-verify rounds, and their counts. draft:
    a model loaded with load_model (same vocabulary), or None for prompt lookup of n-grams."""
    make_room_for_programs()
    prompt = jax.device_put(np.asarray(prompts, dtype=np.int32), _inputs_sharding(model))  # [B, P]
    to_host = None if on_token is None else (lambda token: on_token(token.astype(np.int64)))
    with jax.default_device(_model_device(model)):
        tokens, counts = speculative.generate_speculative(
            model, draft, prompt, as_generation(generation), draft_tokens, ngram, to_host
        )
    return np.asarray(tokens, dtype=np.int64), counts  # [B, P + N]


@exact
def forward_chunks(model: TinyModel, tokens: np.ndarray, chunk_sizes: Sequence[int]) -> np.ndarray:
    """Feed tokens [B, T] into one cache in chunks of the given sizes; the logits [B, T, V]."""
    chunk_sizes = check_chunk_sizes(chunk_sizes, np.shape(tokens)[1])
    make_room_for_programs()
    tokens = jax.device_put(np.asarray(tokens, dtype=np.int32), _inputs_sharding(model))  # [B, T]
    model.eval()
    with jax.default_device(_model_device(model)):
        cache = init_cache(model.config, tokens.shape[0], tokens.shape[1], model.emb.embedding.dtype)
    pieces, start = [], 0
    for size in chunk_sizes:
        logits, cache = prefill_step(model, tokens[:, start : start + size], cache)  # [B, size, V]
        pieces.append(as_host(logits))
        start += size
    return np.concatenate(pieces, axis=1)  # [B, T, V]


def clear_compiled() -> None:
    """Forget every compiled program, so the next call traces again (tests that patch a helper)."""
    jax.clear_caches()


def synchronize(model: TinyModel) -> None:
    # JAX dispatches asynchronously and has no device-wide barrier: wait on every live array
    # on the model's platform, which includes the outputs of anything still running.
    jax.block_until_ready(jax.live_arrays(_model_device(model).platform))


@exact
def matvec_seconds(rows: int, cols: int, repeats: int, device: str = "cpu") -> list[float]:
    """Seconds for each of `repeats` float32 products [rows, cols] @ [cols] (bandwidth.py)."""
    return bandwidth.matvec_seconds(rows, cols, repeats, resolve_device(device))


# ---------------------------------------------------------------- continuous batching
# What kvports/batching's engine calls: a pool of KV blocks shared by the running sequences
# (init_block_pool, from paged.py), and one step of the running batch over it (docs/BATCHING.md).

init_block_pool = exact(paged.init_block_pool)  # the contract's, as paged.py makes it (under x64, as every call)


@exact
def paged_step(
    model: TinyModel,
    pool: Any,
    tokens: np.ndarray,
    start: np.ndarray,
    block_tables: np.ndarray,
    sampling: RowSampling,
    logprobs: int | None = None,
    every_position: bool = False,
) -> tuple[np.ndarray, Any, tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
    """One step of the running batch: tokens [B, T] (PAD on the left of shorter rows) after each row's
    `start` [B] tokens in the pool, block_tables [B, M] (-1 past a row's blocks), sampling: each
    row's temperature, top-k, top-p and draw [B]; logprobs: how many likeliest tokens to report, or
    None; every_position: each position's instead ([B, T], [B, T, K]: a prompt's own). The next
    token of every row [B] (PAD where its logits were not finite), the pool to pass
    to the next step (the one passed in is donated), and, when asked, the chosen tokens' log-probabilities [B]
    and the likeliest ids and their log-probabilities [B, K]."""
    B, T = tokens.shape
    given = np.asarray(tokens)  # [B, T]: the step's own, what each position's log-probability scores
    chunks, block_tables, sampling = paged.static_shapes(
        pool.max_batch, pool.max_blocks, tokens, start, block_tables, sampling, every_position
    )
    on_device = _on_device(model)
    next_tokens, pool, logits = paged.paged_step(
        model,
        pool,
        [on_device(chunk) for chunk, _ in chunks],  # [rows, w] each
        [on_device(chunk_start) for _, chunk_start in chunks],  # [rows] each
        on_device(block_tables),
        on_device(sampling.temperature),
        on_device(sampling.top_k),
        on_device(sampling.top_p),
        on_device(sampling.uniform),
        None if sampling.allowed is None else on_device(sampling.allowed),
        return_logits=logprobs is not None,
        every_position=every_position,
    )
    # Sliced on the host, or each size compiles a slice; every_position: the last T columns
    # (static_shapes pads on the left).
    next_tokens = np.asarray(next_tokens, dtype=np.int64)[:B]  # [B]
    kept = (slice(0, B), slice(-T, None)) if every_position else slice(0, B)
    steps = (
        None
        if logits is None
        else step_logprobs(np.asarray(logits, np.float64)[kept], given, next_tokens, logprobs or 0, every_position)
    )
    return next_tokens, pool, steps  # [B], the pool, ([B], [B, K], [B, K]) ([B, T], [B, T, K] x 2) or None


def _on_device(model: TinyModel) -> Callable[[np.ndarray], jax.Array]:
    """A step's NumPy input to where the model's arrays are, its integers as int32."""
    device = _inputs_sharding(model)

    def on_device(array: np.ndarray) -> jax.Array:
        return jax.device_put(np.asarray(array, dtype=np.int32 if array.dtype.kind == "i" else None), device)

    return on_device


@exact
def compile_paged_steps(
    model: TinyModel,
    pool: Any,
    max_step_tokens: int,
    longest: int,
    on_compiled: Callable[[int, int], None] | None = None,
) -> int:
    """Compile, before a server says it is ready, every program a paged step can need: the forward of
    each (rows, chunk width, blocks a row) static_shapes can run a step in, for steps of B rows of T tokens the
    scheduler can make (B * T within max_step_tokens, or one prompt up to `longest`), with the last
    position's logits and with every position's (a prompt's own log-probabilities); and the row
    sampling of each row count, with and without a mask of allowed tokens (a response format).
    Compiled ahead of time (lowered from a step's own kind of arrays, not run); a later step of the
    same shape finds the program. How many programs it compiled: a fixed few for any `longest`;
    on_compiled(done, total) after each (a progress bar's: SmolLM2's take ~10 s each on a CPU)."""
    forwards: set[tuple[int, int, int, bool]] = set()
    row_counts: set[int] = set()
    for every_position in (False, True):
        for B in range(1, pool.max_batch + 1):
            for T in range(1, longest + 1):
                if B > 1 and B * T > max_step_tokens:
                    break
                rows, widths = paged.step_shape(pool.max_batch, B, T, every_position)
                rungs = paged.block_rungs(pool.max_blocks, T, every_position)
                forwards.update((rows, width, blocks, every_position) for width in widths for blocks in rungs)
                row_counts.add(rows)
    on_device = _on_device(model)
    vocabulary = None
    total, done = len(forwards) + 2 * len(row_counts), 0

    def compiled() -> None:
        nonlocal done
        done += 1
        if on_compiled is not None:
            on_compiled(done, total)

    # Widest first: in the other order the first two one-row shapes were traced again when a step
    # first ran them (seen, cause not found); in this one no shape was.
    for rows, width, blocks, every_position in sorted(forwards, reverse=True):
        tokens = on_device(np.zeros((rows, width), dtype=np.int64))  # [rows, width]
        start = on_device(np.zeros(rows, dtype=np.int64))  # [rows]
        block_tables = on_device(np.zeros((rows, blocks), dtype=np.int64))  # [rows, M]
        lowered = paged._paged_forward.lower(
            *paged.split_once(model), pool, tokens, start, block_tables, every_position
        )
        lowered.compile()
        compiled()
        vocabulary = lowered.out_info[0]  # [rows, V]: the last position's logits, what sampling takes
    assert vocabulary is not None
    sampling = RowSampling.of([], np.zeros(0))  # the dtypes a step's sampling arrays have
    arrays = (sampling.temperature, sampling.top_k, sampling.top_p, sampling.uniform)
    for rows in sorted(row_counts, reverse=True):
        logits = jax.ShapeDtypeStruct((rows, vocabulary.shape[-1]), vocabulary.dtype, sharding=vocabulary.sharding)
        values = [on_device(np.zeros(rows, dtype=array.dtype)) for array in arrays]
        for allowed in (None, on_device(np.ones((rows, vocabulary.shape[-1]), dtype=bool))):
            paged._sample_rows.lower(logits, *values, allowed).compile()
            compiled()
    return total
