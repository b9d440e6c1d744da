"""Ports are imported by name, lazily: an install without JAX (or torch) still runs
the others and reports the missing one as unavailable."""

from __future__ import annotations

import importlib
from typing import cast

from kvports.shared.contract import Port

PORTS = ("torch", "jax", "numpy")
REFERENCE = "torch"
CPU_ONLY = ("numpy",)  # runs on the CPU whatever --device asks for
COMPILES = ("jax",)  # the first call traces and compiles: compare and bench report that time apart
MODULES = {"torch": "kvports.torch_impl.port", "jax": "kvports.jax_impl.port", "numpy": "kvports.numpy_impl.port"}


class PortUnavailable(RuntimeError):
    def __init__(self, name: str, reason: str):
        super().__init__(f"framework {name!r} is not available ({reason})")
        self.name = name
        self.reason = reason


_loaded: dict[str, Port] = {}


def load_port(name: str) -> Port:
    """The port's module, which tests/test_contract.py checks against `Port`."""
    if name not in MODULES:
        raise PortUnavailable(name, f"known frameworks: {', '.join(PORTS)}")
    if name not in _loaded:
        try:
            _loaded[name] = cast(Port, importlib.import_module(MODULES[name]))
        except ImportError as exc:
            raise PortUnavailable(name, str(exc)) from None
    return _loaded[name]


def available_port(name: str) -> Port | None:
    try:
        return load_port(name)
    except PortUnavailable:
        return None
