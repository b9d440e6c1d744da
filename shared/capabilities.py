"""What each port can run, one record per port, and the machine's CPU features: the one table the
application's rules read (kvports.registry's modes and compiling ports, kvports.validation's
precisions and `check_rules`, the bench's formats, kvports.devices' CPU-only ports), and each port's
own load-time check quotes. Adding a precision, a mode or a device to a port is one line here.

The CPU features are shared/cpu.py's answers (KVPORTS_CPU=avx2 answers as an AVX2-only CPU): a
port's CPU-specific route (torch's oneDNN bfloat16 linears) asks them before it is taken.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvports.shared import cpu

ALL_MODES = ("naive", "cached", "speculative", "paged")  # generate's three, and kvports batch's paged engine


@dataclass(frozen=True)
class Capabilities:
    """One port's record."""

    modes: tuple[str, ...]  # the modes it runs
    split_modes: tuple[str, ...]  # those its ranks run split across devices (tensor_parallel > 1)
    precisions: tuple[str, ...]  # the reduced dtypes and quants it offers: where its framework has a fast product
    cpu_quants: tuple[str, ...]  # the quants it runs on the CPU only (one device)
    devices: tuple[str, ...]  # where it runs: "cpu", and "gpu" where its framework reaches one
    compiles: bool  # the first call traces and compiles: compare and bench report that time apart


# torch's ranks each run a whole generate call, with no block pool they share: no paged mode split.
# NumPy has no bfloat16 and no integer matrix product that would beat its own float32 one, splits
# nothing and runs on the CPU only.
PORTS = {
    "torch": Capabilities(ALL_MODES, ALL_MODES[:3], ("bfloat16", "int8", "q4"), ("int8", "q4"), ("cpu", "gpu"), False),
    "jax": Capabilities(ALL_MODES, ALL_MODES, ("bfloat16", "int8", "q4"), (), ("cpu", "gpu"), True),
    "numpy": Capabilities(ALL_MODES, (), (), (), ("cpu",), False),
}


def cpu_features() -> frozenset[str]:
    """This machine's CPU features, as the CPU-specific routes see them (shared/cpu.py)."""
    return cpu.cpu_flags()


def refusal(port: str, dtype: str, quant: str, tensor_parallel: int) -> str | None:
    """Why `port` cannot load a model so (a precision it lacks, a split it does not make), or None:
    the port's own load-time check, after the application's rules refused the same with a user's
    message."""
    offered = PORTS[port]
    for value in (dtype, quant):
        if value not in ("float32", "float64", "none") and value not in offered.precisions:
            return f"{port} offers {', '.join(offered.precisions) or 'float32 and float64 only'}, not {value}"
    if tensor_parallel > 1 and not offered.split_modes:
        return f"{port} splits no mode across devices"
    return None
