"""Fixtures of the bad-input files."""

from __future__ import annotations

import pytest

from kvports.formats.weights import SafetensorsFile


@pytest.fixture
def no_tensor_may_be_read(monkeypatch):
    """A bad input the header shows must be refused before a byte of tensor data is read."""

    def refuse(self, name):
        raise AssertionError(f"tensor {name} was read before the header was checked")

    monkeypatch.setattr(SafetensorsFile, "read", refuse)
