"""Fixtures shared by every test: the ports, by name, and the seed's model."""

from __future__ import annotations

import numpy as np
import pytest

from kvports.shared.ports import PORTS, available_port
from kvports.shared.weights import load_weights

GOLDEN = [315, 391, 221, 120, 342, 371, 223, 418, 20, 350, 493, 286, 342, 444, 438, 281,
          424, 121, 456, 214, 244, 113, 142, 198, 381, 65, 409, 15, 299, 483, 94, 398,
          454, 387, 344, 214, 477, 230, 223, 421, 43, 481, 172, 103, 26, 252, 226, 134,
          492, 358, 243, 34, 493, 458, 337, 495, 17, 249, 435, 301, 360, 432, 374, 274,
          316, 57, 82, 163, 122, 421, 136, 41, 383, 107, 467, 143, 424, 456, 239, 391,
          253, 301, 279, 358, 491, 390, 366, 444, 476, 464, 136, 428, 29, 194, 175, 46,
          147, 83, 75, 289]  # the seed's README: torch.manual_seed(0) model, 100 greedy tokens
SEED_PROMPT = np.array([[160, 248, 104, 209, 394]], dtype=np.int64)


def port_or_skip(name: str):
    port = available_port(name)
    if port is None:
        pytest.skip(f"{name} is not installed")
    return port


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


def random_weights(config, seed: int = 0):
    """Weights for any config, from the reference initialisation (torch)."""
    return port_or_skip("torch").init_weights(config, seed)
