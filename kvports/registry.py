"""Ports are imported by name, lazily: an install without JAX (or torch) still runs
the others and reports the missing one as unavailable. Only a framework that is not
installed makes its port unavailable: any other ImportError, in a port or in what it
imports, is a bug and surfaces as the error it is."""

from __future__ import annotations

import importlib
import importlib.util
from typing import cast

from kvports.shared.contract import Port

PORTS = ("torch", "jax", "numpy")
REFERENCE = "torch"
CPU_ONLY = ("numpy",)  # runs on the CPU whatever --device asks for
COMPILES = ("jax",)  # the first call traces and compiles: compare and bench report that time apart
MODULES = {"torch": "kvports.torch_impl.port", "jax": "kvports.jax_impl.port", "numpy": "kvports.numpy_impl.port"}
# The modes each port runs: generate's naive, cached and speculative, and kvports batch's paged engine
# (init_block_pool, paged_step); SPLIT_MODES: those its ranks run split across devices (tensor_parallel > 1):
# torch's ranks each run a whole generate call, with no block pool they share; NumPy splits nothing.
MODES = {name: ("naive", "cached", "speculative", "paged") for name in PORTS}
SPLIT_MODES = {"torch": ("naive", "cached", "speculative"), "jax": MODES["jax"], "numpy": ()}
FRAMEWORK_PACKAGES = {"torch": ("torch",), "jax": ("jax", "flax"), "numpy": ()}  # NumPy: kvports' own dependency


class PortUnavailable(RuntimeError):
    def __init__(self, name: str, reason: str):
        super().__init__(f"framework {name!r} is not available ({reason})")
        self.name = name
        self.reason = reason


_loaded: dict[str, Port] = {}


def load_port(name: str) -> Port:
    """The port's module, which tests/structure/test_contract.py checks against `Port`."""
    if name not in MODULES:
        raise PortUnavailable(name, f"known frameworks: {', '.join(PORTS)}")
    if name not in _loaded:
        if missing_packages(name):
            raise PortUnavailable(name, not_installed(name))
        _loaded[name] = cast(Port, importlib.import_module(MODULES[name]))
    return _loaded[name]


def missing_packages(name: str) -> list[str]:
    """The framework packages port `name` needs that are not installed."""
    return [package for package in FRAMEWORK_PACKAGES[name] if importlib.util.find_spec(package) is None]


def not_installed(name: str) -> str:
    """Why port `name` is not available, in words: the framework packages it lacks."""
    return f"{' and '.join(missing_packages(name)) or name} not installed"


def available_port(name: str) -> Port | None:
    try:
        return load_port(name)
    except PortUnavailable:
        return None
