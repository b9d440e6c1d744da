"""Ports by name: loaded or skipped where their framework is not installed, hidden as if not
installed, and the context for calling a port's lesson files directly."""

from __future__ import annotations

import contextlib

import pytest

from kvports import registry
from kvports.shared.contract import Port


def port_or_skip(name: str) -> Port:
    """The port, skipping only where its framework is not installed: a port that fails to import is a failure."""
    missing = registry.missing_packages(name)
    if missing:
        pytest.skip(f"{name} is not installed ({', '.join(missing)} missing)")
    return registry.load_port(name)


def hide_port(monkeypatch: pytest.MonkeyPatch, name: str, reason: str) -> None:
    """From here on, loading port `name` fails as it does where the framework is not installed."""
    real = registry.load_port

    def load_port(wanted: str) -> Port:
        if wanted == name:
            raise registry.PortUnavailable(wanted, reason)
        return real(wanted)

    monkeypatch.setattr(registry, "load_port", load_port)


def calling_internals(port: Port) -> contextlib.AbstractContextManager:
    """The context for a test that calls a port's model.py, sampling.py, generate.py or speculative.py
    directly: the JAX port's own calls run in JAX's x64 mode (jax_impl/port.py's `exact`), which is
    not on for the process, so such a test turns it on as they do."""
    if port.NAME == "jax":
        import jax

        return jax.enable_x64(True)
    return contextlib.nullcontext()
