"""Every runner x mode: loaded, measured and compared. A runner that cannot run (not
installed, no GPU, a config a baseline cannot hold) gets rows that say why."""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from kvports import generating, loading, registry
from kvports.bench.formats import Formats, format_name
from kvports.bench.measure import (
    MATVEC_REPEATS,
    MATVEC_SHAPE,
    RowCall,
    decode_bytes,
    format_of,
    matvec_bandwidth,
    measure_row,
    peer_threads,
)
from kvports.bench.runners import Runner, import_runner, note
from kvports.shared.config import ModelConfig, host_dtype, kv_cache_bytes
from kvports.shared.contract import Port
from kvports.shared.errors import UserError
from kvports.shared.quantization import float_tensors, is_q4_part, q4_blocks
from kvports.threads import settle_threads

MEASURES = (
    "ttft_ms",
    "decode_ms_per_token",
    "decode_ms_p90",
    "tokens_per_s",
    "pp_tokens_per_s",
    "tg_tokens_per_s",
    "total_s",
    "compile_s",
    "kv_cache_bytes",
    "roofline_ratio",
    "speedup_vs_cached",
    "agree_steps",
)


def own_rows(runner: Runner) -> bool:
    """A port's own rows: loaded through the run layer, at every weight format, split at each N > 1."""
    return runner.framework in registry.PORTS and runner.variant is None and not runner.peer


def runs_formats(runner: Runner) -> bool:
    """A port's own rows and its compiled row run at each weight format asked for (a compiled kernel may
    close a format's gap where eager's does not); a baseline's and a peer's once."""
    return runner.framework in registry.PORTS and not runner.peer


def parallel_runs(
    runners: list[Runner], sizes: tuple[int, ...], formats: Formats
) -> list[tuple[Runner, int, tuple[str, str]]]:
    """Every runner at N = 1; the ports that split a model (torch, jax) again at each N > 1 asked for.
    A port and its compiled row at every weight format the port offers (N > 1 runs unquantized: a split
    model keeps float weights), a peer at the first dtype (its weights are its own), a baseline at the
    first format."""
    runs = []
    for runner in runners:
        first = (formats.first[0], "none") if runner.peer else formats.first
        pairs = formats.of(runner.framework) if runs_formats(runner) else [first]
        for dtype, quant in pairs:
            runs.append((runner, 1, (dtype, quant)))
            if runner.framework in ("torch", "jax") and own_rows(runner) and quant == "none":
                runs.extend((runner, n, (dtype, quant)) for n in sizes if n > 1)
    return runs


def compute_itemsize(dtype: str) -> int:
    """The bytes of one weight or cache entry as the port computes: bfloat16's 2, though it is read at float32."""
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


def format_tensors(tensors: dict[str, np.ndarray], dtype: str, quant: str) -> dict[str, np.ndarray]:
    """The tensors one row loads: the float ones at `dtype`'s host dtype (no copy where they are read at
    it; the casts were checked as they were read), and a GGUF file's 4-bit blocks only for a q4 row."""
    floats = {name: array.astype(host_dtype(dtype), copy=False) for name, array in float_tensors(tensors).items()}
    return (
        {**floats, **{name: array for name, array in tensors.items() if is_q4_part(name)}} if quant == "q4" else floats
    )


def parallel_note(tensor_parallel: int, device: str) -> str:
    if device == "cpu":
        return (
            f"split across {tensor_parallel} devices; on the CPU these share its cores (JAX's simulated devices, "
            "torch's processes), so the row measures the split's communication overhead, not a speed-up"
        )
    return f"split across {tensor_parallel} GPUs (Megatron-style, all-reduce after each row-parallel product)"


def unavailable_row(
    runner: Runner, mode: str, reason: str | None, dtype: str = "float32", quant: str = "none", tensor_parallel: int = 1
) -> dict[str, Any]:
    # Every field a row has, empty: a reader of the JSON need not special-case it. A peer's weights are its own.
    return {
        "framework": runner.framework,
        "variant": runner.variant,
        "mode": mode,
        "weights": None if runner.peer else format_name(dtype, quant),
        "dtype": dtype,
        "quant": quant,
        "available": False,
        "reason": reason,
        "tensor_parallel": tensor_parallel,  # a split that cannot run says which
        **dict.fromkeys(MEASURES),
        "per_step_ms": [],
        "speculative": None,
    }


@dataclass(frozen=True)
class RowSettings:
    """What every row of one bench run shares: the runners and modes, the model and its prompts,
    the flags. formats: the weight formats each port runs (the others run at the first);
    draft_weights: the speculative rows' draft (None: prompt lookup); unusable: runners (by label)
    that cannot run (a rule, or no way to reach --device), and why; pp_prompts [B, P']: the
    prompt each row also prefills for its pp figure (None: none timed)."""

    runners: list[Runner]
    modes: list[str]
    config: ModelConfig
    tensors: dict[str, np.ndarray]
    prompts: np.ndarray  # [B, P]
    args: argparse.Namespace
    formats: Formats
    sweep: list[int]
    roofline: bool
    draft_weights: tuple[ModelConfig, dict[str, np.ndarray]] | None = None
    unusable: dict[str, str] = field(default_factory=dict)
    pp_prompts: np.ndarray | None = None


@dataclass
class Bandwidths:
    """Each library's streaming bandwidth, measured by its matrix-vector probe on its device."""

    bandwidth: dict[str, float] = field(default_factory=dict)
    matvec: dict[str, list[float]] = field(default_factory=dict)
    device: dict[str, str] = field(default_factory=dict)
    probes: dict[str, Any] = field(default_factory=dict)  # library -> the module whose probe measured it
    probed: int = 1  # times each probe ran

    def measure(self, library: str, module: Any, device: str) -> None:
        self.probes[library] = module
        self.matvec[library] = module.matvec_seconds(*MATVEC_SHAPE, MATVEC_REPEATS, device)
        self.bandwidth[library] = matvec_bandwidth(self.matvec[library])
        self.device[library] = device

    def measure_again(self) -> None:
        """Once more, keeping each library's better figure (a probe another process disturbed)."""
        for name, module in self.probes.items():
            again = module.matvec_seconds(*MATVEC_SHAPE, MATVEC_REPEATS, self.device[name])
            if matvec_bandwidth(again) > self.bandwidth[name]:
                self.matvec[name], self.bandwidth[name] = again, matvec_bandwidth(again)
        self.probed = 2


def run_rows(
    settings: RowSettings, progress: Any, on_runner_done: Callable[[list[dict[str, Any]]], None] | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(rows, what the machine did: versions, bandwidths, the roofline's bytes per step);
    on_runner_done(rows so far) after each runner."""
    args = settings.args
    calls_per_mode = 2 * args.warmup + args.repeats + len(settings.sweep)
    runs = parallel_runs(settings.runners, getattr(args, "tensor_parallel", (1,)), settings.formats)
    modes_of = {id(runner): [mode for mode in runner.modes if mode in settings.modes] for runner, _, _ in runs}
    task = progress.add_task("bench", total=sum(calls_per_mode * len(modes_of[id(runner)]) for runner, _, _ in runs))

    def tick(description: str) -> None:
        progress.update(task, advance=1, description=description)

    rows: list[dict[str, Any]] = []
    bandwidths = Bandwidths()
    if settings.roofline:
        # NumPy's bandwidth always: the CPU's roofline even when no other framework is installed.
        progress.update(task, description="numpy bandwidth")
        bandwidths.measure("numpy", registry.load_port("numpy"), "cpu")
    versions: dict[str, str] = {"numpy": np.__version__}
    for runner, tensor_parallel, (dtype, quant) in runs:
        runner_modes = modes_of[id(runner)]
        if not runner_modes:
            continue
        device = args.device if runner.gpu else "cpu"
        module, model, loaded, reason = load_row_model(settings, runner, dtype, quant, device, tensor_parallel)
        if module is None or model is None:
            rows.extend(unavailable_row(runner, mode, reason, dtype, quant, tensor_parallel) for mode in runner_modes)
            progress.update(task, advance=calls_per_mode * len(runner_modes))
            continue
        versions.update(module.versions())
        if settings.roofline and runner.library not in bandwidths.bandwidth:
            progress.update(task, description=f"{runner.library} bandwidth")
            bandwidths.measure(runner.library, module, device)
        for mode in runner_modes:
            rows.append(
                runner_row(settings, runner, module, model, loaded, mode, (dtype, quant, device, tensor_parallel), tick)
            )
        del model, loaded
        gc.collect()  # gpt2-small: free one framework's copy of the weights before the next loads
        if on_runner_done is not None:
            on_runner_done(rows)
    machine = machine_figures(settings, rows, bandwidths, lambda: progress.update(task, description="bandwidth again"))
    add_comparisons(rows, settings.prompts.shape[1], keep_tokens=getattr(args, "group", None) is not None)
    return rows, {"versions": versions, **machine}


def load_row_model(
    settings: RowSettings, runner: Runner, dtype: str, quant: str, device: str, tensor_parallel: int
) -> tuple[Any, Any, loading.LoadedModel | None, str]:
    """(the runner's module, its model, the run layer's LoadedModel for a port's own rows, the reason
    it cannot run): a module or model of None is a row that says why."""
    args = settings.args
    module, reason = import_runner(runner)
    settle_threads()  # torch's pools exist once it is imported
    if module is not None and runner.label in settings.unusable:
        module, reason = None, settings.unusable[runner.label]
    model, loaded = None, None
    # A peer is handed the weights file (llama.cpp runs the GGUF itself) and the bench's thread count.
    options = {"source": args.weights, "threads": peer_threads(), **dict(runner.options)} if runner.peer else {}
    if quant != "none" and not runner.peer:
        options["quant"] = quant  # a baseline without it fails to load: a row that says why
    if module is None:
        return None, None, None, str(reason)
    try:
        row_tensors = format_tensors(settings.tensors, dtype, quant)
        if own_rows(runner):  # its model is the run layer's
            port = cast(Port, module)
            config = settings.config
            loaded = loading.load_model(
                runner.framework,
                config,
                row_tensors,
                dtype,
                device,
                quant=quant,
                tensor_parallel=tensor_parallel,
                port=port,
            )
            model = loaded.model
        else:
            model = module.load_model(settings.config, row_tensors, dtype, device, **options)
    except UserError as exc:  # a split beyond the port's devices: the line generate would refuse it with
        reason = str(exc)
    except Exception as exc:  # a missing GPU, or a config this baseline cannot run
        reason = f"{type(exc).__name__}: {exc}"
    return module, model, loaded, str(reason)


def runner_row(
    settings: RowSettings,
    runner: Runner,
    module: Any,
    model: Any,
    loaded: loading.LoadedModel | None,
    mode: str,
    where: tuple[str, str, str, int],
    tick: Callable[[str], None],
) -> dict[str, Any]:
    """One mode's row of a loaded runner: measured, or unavailable with the reason it failed.
    where: (dtype, quant, device, tensor_parallel)."""
    args = settings.args
    dtype, quant, device, tensor_parallel = where
    # The weight format the row computes on: a peer's own (llama.cpp's file: Q4_1, say, which names its
    # row), else its dtype and quantization (formats.format_name).
    weights = getattr(model, "weights", None) if runner.peer else format_name(dtype, quant)
    row = {
        "framework": runner.framework,
        "variant": weights if runner.peer and runner.variant is None else runner.variant,
        "mode": mode,
        "weights": weights,
        "available": True,
        "device": device,
        "dtype": dtype,
        "quant": quant,
        "route": loaded.route if loaded is not None else None,  # a port's linears' kernel (fallbacks show)
        "tensor_parallel": tensor_parallel,
    }
    call = RowCall(mode, loaded)
    if mode == "speculative":
        assert loaded is not None  # only a port's rows are speculative
        if settings.draft_weights is not None:
            loaded.add_draft(str(args.draft), *settings.draft_weights)
        call = RowCall(mode, loaded, generating.Draft(str(args.draft), args.draft_tokens, args.ngram))
    try:
        row.update(
            measure_row(runner, module, model, call, settings.prompts, args, settings.sweep, tick, settings.pp_prompts)
        )
    except Exception as exc:
        if runner.variant is None and not runner.baseline and not runner.peer:
            raise  # a port that fails is a bug to see whole
        # A baseline, a peer or the compiled row that cannot run this model (torch.compile failing to
        # lower it, say) is a row that says why, not the end of the bench.
        why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        return unavailable_row(runner, mode, why, dtype, quant, tensor_parallel)
    B, P = settings.prompts.shape
    itemsize = compute_itemsize(dtype)
    row["kv_cache_bytes"] = cache_bytes_held(
        runner, mode, settings.config, B, P, args.new_tokens, itemsize, args.draft_tokens
    )
    row["note"] = note(runner, mode) if tensor_parallel == 1 else parallel_note(tensor_parallel, device)
    return row


def machine_figures(
    settings: RowSettings, rows: list[dict[str, Any]], bandwidths: Bandwidths, again: Callable[[], None]
) -> dict[str, Any]:
    """The rooflines (written into the rows) and what the machine did: a decode step's bytes at each
    dtype a row computes in and in each row's own weight format, the bandwidths, the probes."""
    config, tensors = settings.config, settings.tensors
    B, P = settings.prompts.shape
    N = settings.args.new_tokens
    row_dtypes = dict.fromkeys(row["dtype"] for row in rows)
    floats = float_tensors(tensors)
    four_bit = frozenset(name for name in floats if q4_blocks(tensors, name) is not None)
    step_bytes, format_bytes = {}, {}
    if settings.roofline:
        step_bytes = {name: decode_bytes(config, floats, B, P, N, compute_itemsize(name)) for name in row_dtypes}
        for weights in dict.fromkeys(str(row["weights"]) for row in rows if row["available"]):
            dtype, quant = format_of(weights)
            format_bytes[weights] = decode_bytes(config, floats, B, P, N, compute_itemsize(dtype), quant, four_bit)
    best = add_rooflines(rows, bandwidths.bandwidth, bandwidths.device, format_bytes)
    if any(row.get("roofline_ratio") is not None and row["roofline_ratio"] < 1 for row in rows):
        # Faster than the bandwidth allows: the probe ran while something else held the memory bus. Once more,
        # keeping each library's better figure; a row still below 1 is flagged in its note.
        again()
        bandwidths.measure_again()
        best = add_rooflines(rows, bandwidths.bandwidth, bandwidths.device, format_bytes)
    matvec = bandwidths.matvec
    return {
        "bandwidth_gb_s": {
            f"{name} ({bandwidths.device[name]})": value / 1e9 for name, value in bandwidths.bandwidth.items()
        }
        or None,
        "roofline_bandwidth_gb_s": {device: value / 1e9 for device, value in best.items()} or None,
        "decode_bytes_per_step": step_bytes.get(settings.formats.first[0]),
        "decode_bytes_per_step_by_dtype": step_bytes or None,
        "decode_bytes_per_step_by_format": format_bytes or None,
        "matvec": {"shape": list(MATVEC_SHAPE), "dtype": "float32", "seconds": matvec} if matvec else None,
        "bandwidth_probes": bandwidths.probed if matvec else 0,
    }


DISTURBED = "below 1: decode ran faster than the bandwidth probe allows, so the probe was disturbed (measured twice)"


def add_rooflines(
    rows: list[dict[str, Any]], bandwidth: dict[str, float], device_of: dict[str, str], step_bytes: dict[str, float]
) -> dict[str, float]:
    """Each live row's roofline (ms) and its decode ms over it; the best bandwidth per device, returned.
    One roofline per device: the best streaming bandwidth any framework reached on it; step_bytes: a
    decode step's bytes by the row's weight format (`weights`; empty: no roofline)."""
    best: dict[str, float] = {}
    for name, value in bandwidth.items():
        best[device_of[name]] = max(value, best.get(device_of[name], 0.0))
    for row in rows:
        if row["available"]:
            # A decode step's bytes over the bandwidth; a speculative round reads the weights once for several
            # tokens, so its per-token time has no roofline of this kind.
            row_bytes = step_bytes.get(str(row["weights"]))
            measured = row_bytes is not None and row["device"] in best and row["mode"] != "speculative"
            row["roofline_ms"] = 1e3 * row_bytes / best[row["device"]] if row_bytes is not None and measured else None
            row["roofline_ratio"] = (
                None if row["roofline_ms"] is None else row["decode_ms_per_token"] / row["roofline_ms"]
            )
            row["roofline_disturbed"] = row["roofline_ratio"] is not None and row["roofline_ratio"] < 1
    return best


def cache_bytes_held(
    runner: Runner,
    mode: str,
    config: ModelConfig,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    itemsize: int,
    draft_tokens: int,
) -> int | None:
    """The target's cache (a speculative draft model's own cache is not counted; a peer's is its own, not
    counted)."""
    if runner.peer:
        return None
    if mode == "naive":
        return 0  # no cache: every step recomputes k and v for the whole history
    if runner.baseline:
        # Grown, not preallocated: the last token is never fed back, so P + N - 1 positions.
        return kv_cache_bytes(config, batch, prompt_len + new_tokens - 1, itemsize)
    if mode == "speculative":
        # Room for a verified chunk of K + 1 past the last token kept (and K spare slots in a ring).
        K = draft_tokens
        return kv_cache_bytes(config, batch, prompt_len + new_tokens + K + 1, itemsize, chunk=K + 1)
    return kv_cache_bytes(config, batch, prompt_len + new_tokens, itemsize)


def agree_steps(tokens: np.ndarray, reference: np.ndarray, prompt_len: int) -> int:
    """How many leading new tokens equal the reference's in every row of the batch."""
    same = np.all(tokens[:, prompt_len:] == reference[:, prompt_len:], axis=0)  # [N]
    return int(same.size if same.all() else np.argmin(same))


def add_comparisons(rows: list[dict[str, Any]], prompt_len: int, keep_tokens: bool = False) -> None:
    """Speed-ups the targets name: decode per token against seed-concat, total against the same port's naive,
    and a speculative row's total against the same port's cached; each row's tokens against the reference's,
    then the tokens dropped (keep_tokens: kept as lists, for bench.rounds to compare across its processes)."""
    live = [row for row in rows if row["available"]]
    if not live:
        return
    seed = next((row for row in live if row["framework"] == "seed-concat"), None)
    reference = next((row for row in live if row["framework"] == "torch" and row["variant"] is None), live[0])
    # The float32 reference every row (a peer's, a port's in fewer bits) is held to, step by step: torch cached
    # at float32, else torch cached at the first format, else the first port's row.
    ports_live = [row for row in live if row["framework"] in registry.PORTS and row["variant"] is None] or live
    torch_cached = [row for row in ports_live if row["framework"] == "torch" and row["mode"] == "cached"]
    agree_reference = next(
        (row for row in torch_cached if row["weights"] == "float32" and row.get("tensor_parallel", 1) == 1),
        torch_cached[0] if torch_cached else ports_live[0],
    )

    def same_port(row: dict[str, Any], mode: str) -> dict[str, Any] | None:
        """The row's own port, format and split in another mode."""
        return next(
            (
                r
                for r in live
                if (r["framework"], r["weights"], r.get("tensor_parallel", 1))
                == (row["framework"], row["weights"], row.get("tensor_parallel", 1))
                and r["variant"] is None
                and r["mode"] == mode
            ),
            None,
        )

    for row in live:
        row["decode_speedup_vs_seed_concat"] = (
            None
            if seed is None or row["decode_ms_per_token"] is None
            else seed["decode_ms_per_token"] / row["decode_ms_per_token"]
        )
        naive, cached = same_port(row, "naive"), same_port(row, "cached")
        row["total_speedup_vs_naive"] = (
            None if naive is None or row["mode"] == "naive" else naive["total_s"] / row["total_s"]
        )
        # Speculative against the same port's cached greedy path, both whole generations: the decode speed-up
        # a draft buys (JAX's speculative loop streams nothing to time step by step).
        row["speedup_vs_cached"] = (
            None if cached is None or row["mode"] != "speculative" else cached["total_s"] / row["total_s"]
        )
        row["tokens_agree"] = bool(np.array_equal(row["tokens"], reference["tokens"]))
        row["tokens_reference"] = f"{reference['framework']} {reference['mode']}"
        row["agree_steps"] = agree_steps(row["tokens"], agree_reference["tokens"], prompt_len)
        row["agree_reference"] = (
            f"{agree_reference['framework']} {agree_reference['mode']} {agree_reference['weights']}"
        )
    for row in live:
        if keep_tokens:
            row["tokens"] = np.asarray(row["tokens"]).tolist()
        else:
            del row["tokens"]
