"""Fixtures shared by every test (the ports, by name, and the seed's model) and the session's
settings. Helpers and constants live in tests/helpers.py; nothing imports this file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvports.shared.ports import PORTS
from kvports.shared.weights import load_weights

# Still importable from here for test_generation.py and test_pitfalls.py until they import
# tests.helpers; remove these three then.
from tests.helpers import GOLDEN, SEED_PROMPT, port_or_skip, random_weights  # noqa: F401

# JAX keeps what it compiles on disk, so a second run of the suite skips the compiles (most of
# the JAX tests' time). Set before anything imports jax; a user's own setting wins.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "jax")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


@pytest.fixture(params=PORTS)
def port(request):
    """Each port's NumPy-in/NumPy-out module (torch_impl.port, jax_impl.port, numpy_impl.port)."""
    return port_or_skip(request.param)


@pytest.fixture
def reference():
    return port_or_skip("torch")


@pytest.fixture(scope="session")
def seed_weights():
    return load_weights()
