"""Ports are imported by name, lazily: an install without JAX (or torch) still runs
the others and reports the missing one as unavailable. Only a framework that is not
installed makes its port unavailable: any other ImportError, in a port or in what it
imports, is a bug and surfaces as the error it is."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
from typing import cast

from kvports.shared.capabilities import PORTS as CAPABILITIES
from kvports.shared.contract import Port

PORTS = tuple(CAPABILITIES)  # torch, jax, numpy
REFERENCE = "torch"
# What each port runs is shared/capabilities.py's table; these are its views the rules read.
CPU_ONLY = tuple(name for name, port in CAPABILITIES.items() if "gpu" not in port.devices)  # whatever --device asks
COMPILES = tuple(name for name, port in CAPABILITIES.items() if port.compiles)
MODULES = {"torch": "kvports.torch_impl.port", "jax": "kvports.jax_impl.port", "numpy": "kvports.numpy_impl.port"}
MODES = {name: port.modes for name, port in CAPABILITIES.items()}
SPLIT_MODES = {name: port.split_modes for name, port in CAPABILITIES.items()}
FRAMEWORK_PACKAGES = {"torch": ("torch",), "jax": ("jax", "flax"), "numpy": ()}  # NumPy: kvports' own dependency
# The oldest release of each framework package the ports run on, and what they need from it: a machine's own
# CUDA builds are often older than the pinned torch (make check-floors runs the port tests on these).
# Newer switches have an older route in the port (torch's TF32 switches).
MINIMUM = {
    # torch 2.6's F.rms_norm rounds bfloat16 in bfloat16: its bfloat16 logits moved past the format's distance.
    "torch": ("2.7", "F.rms_norm summing bfloat16 in float32, SDPA's enable_gqa, aten._weight_int4pack_mm_for_cpu"),
    "jax": ("0.8.1", "jax.enable_x64, and flax 0.12.1 needs it"),
    "flax": ("0.12.1", "nnx.List, Variable.set_value"),
}


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
        if outdated(name):
            raise PortUnavailable(name, str(outdated(name)))
        _loaded[name] = cast(Port, importlib.import_module(MODULES[name]))
    return _loaded[name]


def missing_packages(name: str) -> list[str]:
    """The framework packages port `name` needs that are not installed."""
    return [package for package in FRAMEWORK_PACKAGES[name] if importlib.util.find_spec(package) is None]


def release(version: str) -> tuple[int, ...]:
    """A version's leading numbers: "2.5.1+cu124" -> (2, 5, 1)."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def outdated(name: str) -> str | None:
    """Why port `name` cannot run on the installed release of its framework (older than MINIMUM), or None
    (none older, or a package without a release to read: not installed, or a build without metadata)."""
    for package in FRAMEWORK_PACKAGES[name]:
        lowest, needs = MINIMUM[package]
        try:
            installed = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
        if release(installed) < release(lowest):
            return (
                f"{package} {installed} is older than {lowest}, which kvports needs ({needs}): "
                f"pip install '{package}>={lowest}'"
            )
    return None


def not_installed(name: str) -> str:
    """Why port `name` is not available, in words: the framework packages it lacks."""
    return f"{' and '.join(missing_packages(name)) or name} not installed"


def available_port(name: str) -> Port | None:
    try:
        return load_port(name)
    except PortUnavailable:
        return None
