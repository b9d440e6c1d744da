"""`--device {cpu,gpu}` on generate, compare and bench: where each framework runs, and why one
cannot run there.

NumPy runs on the CPU whatever is asked. On a GPU, float32 means float32: every port turns
TF32 off (`resolve_device`). With `--device gpu`, a framework that cannot reach a GPU (a
CPU-only wheel, no GPU visible) gets rows that say why; when none of the frameworks asked for
can, the command is one `error:` line before anything runs.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping, Sequence

from kvports import registry
from kvports.shared.config import ModelConfig
from kvports.shared.contract import Port
from kvports.shared.errors import UserError

DEVICES = ("cpu", "gpu")


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="gpu: torch and JAX on the GPU, float32 at full precision (no TF32); NumPy stays on the CPU (default cpu)",
    )


def placement(name: str, device: str) -> str:
    """Where framework `name` runs when `device` is asked for."""
    return "cpu" if name in registry.CPU_ONLY else device


def device_problem(port: Port, device: str) -> str | None:
    """Why this port cannot run where `device` puts it (the port's own one-line reason), or None."""
    try:
        port.resolve_device(placement(port.NAME, device))
    except RuntimeError as exc:
        return str(exc)
    return None


def check_cpu_only(device: str, frameworks: Sequence[str], shown: str = "--device gpu") -> None:
    """A GPU asked for frameworks that all run on the CPU only (NumPy): before any is imported.
    `shown` names the device as the caller wrote it (`--device gpu`, `device='gpu'`)."""
    if device == "gpu" and frameworks and all(name in registry.CPU_ONLY for name in frameworks):
        runs = "runs" if len(frameworks) == 1 else "run"
        raise UserError(f"{shown}: {', '.join(frameworks)} {runs} on the CPU only")


def check_gpu_reachable(device: str, problems: Mapping[str, str | None], shown: str = "--device gpu") -> None:
    """`problems`: each framework asked for -> why it cannot run on its device (None: it can).
    With --device gpu, at least one framework that runs on GPUs at all must reach one; when one
    framework is asked for, its own reason is the error, as `check_device` gives it."""
    if device != "gpu":
        return
    check_cpu_only(device, list(problems), shown)
    candidates = {name: problem for name, problem in problems.items() if name not in registry.CPU_ONLY}
    if all(candidates.values()):
        if len(candidates) == 1:
            raise UserError(f"{shown}: {next(iter(candidates.values()))}")
        raise UserError(f"{shown}: no GPU here (" + "; ".join(f"{n}: {p}" for n, p in candidates.items()) + ")")


def check_device(port: Port, device: str, shown: str | None = None) -> None:
    """One framework on one device (`generate`, `batch`, the Python API): its reason as the error,
    after the device as the caller names it (`--device gpu`, `device='gpu'`)."""
    shown = f"--device {device}" if shown is None else shown
    check_cpu_only(device, [port.NAME], shown)
    problem = device_problem(port, device)
    if problem is not None:
        raise UserError(f"{shown}: {problem}")


# ---------------------------------------------------------------- tensor parallelism's devices
SIMULATED_DEVICES = "--xla_force_host_platform_device_count"


def prepare_tensor_parallel(tensor_parallel: int, device: str, frameworks: Sequence[str]) -> None:
    """JAX on the CPU splits a model across N simulated devices, which XLA makes once, when JAX
    starts: ask for them before that (XLA_FLAGS before JAX is imported, its own setting after).
    Once it has started with fewer, `check_parallel_devices` refuses N."""
    if tensor_parallel < 2 or device != "cpu" or "jax" not in frameworks:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    asked = re.search(rf"{SIMULATED_DEVICES}=(\d+)", flags)
    count = max(tensor_parallel, int(asked.group(1)) if asked else 1)
    if "jax" not in sys.modules:
        rest = re.sub(rf"\s*{SIMULATED_DEVICES}=\d+", "", flags).strip()
        os.environ["XLA_FLAGS"] = f"{rest} {SIMULATED_DEVICES}={count}".strip()
        return
    jax = sys.modules["jax"]  # imported already: shared imports no framework itself
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # JAX's CPU backend has started: its device count is fixed
        pass


def tensor_parallel_layout(config: ModelConfig, tensor_parallel: int) -> str:
    """What N devices hold, in words: "2 devices, 2 of 4 query heads and 1 of 2 key/value heads each", or
    "4 devices, ...: replicating 2 key/value heads across 4 devices" where N exceeds them (vLLM's rule)."""
    from kvports.shared.checks import kv_layout

    N, H, Hkv = tensor_parallel, config.n_heads, config.kv_heads
    shown = f"{N} devices, {H // N} of {H} query heads and {config.ffn_dim // N} of {config.ffn_dim} FFN columns each"
    if kv_layout(config, N) == "replicate":
        return f"{shown}: replicating {Hkv} key/value heads across {N} devices"
    return f"{shown}, {Hkv // N} of {Hkv} key/value heads"


def parallel_devices(framework: str, device: str) -> int | None:
    """How many devices `framework` can split a model across on `device`; None: no bound (torch
    on the CPU runs one process per shard)."""
    return registry.load_port(framework).device_count(device)


def check_parallel_devices(framework: str, device: str, tensor_parallel: int, shown: str) -> None:
    """N devices there: `shown` names N as the caller wrote it (`--tensor-parallel 4`, `tensor_parallel=4`)."""
    count = parallel_devices(framework, device) if tensor_parallel > 1 else None
    if count is not None and tensor_parallel > count:
        started = " (JAX had started with fewer before kvports could ask for more)" if framework == "jax" else ""
        raise UserError(f"{shown} is above the {count} {device} devices here{started}")
