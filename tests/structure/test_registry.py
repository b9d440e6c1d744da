"""Ports load by name: unavailable only where their framework is not installed; any other
ImportError, in a port or in what it imports, is the error it is."""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import sys

import pytest

from kvports import registry


class BrokenImport(importlib.abc.MetaPathFinder):
    """Imports of one module fail as a typo'd import inside a port would."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            raise ImportError(f"cannot import name 'nn_typo' from {fullname!r}", name=fullname)
        return None


def forget_port(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """From here on (until the test ends), port `name` is imported afresh."""
    monkeypatch.setattr(registry, "_loaded", {})
    package = registry.MODULES[name].rsplit(".", 1)[0]
    for module in [module for module in sys.modules if module == package or module.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, module)


def test_an_import_error_inside_a_port_surfaces_instead_of_reading_as_not_installed(monkeypatch):
    forget_port(monkeypatch, "numpy")
    monkeypatch.setattr(sys, "meta_path", [BrokenImport("kvports.numpy_impl.nn"), *sys.meta_path])
    with pytest.raises(ImportError, match="nn_typo") as failure:
        registry.load_port("numpy")
    assert not isinstance(failure.value, registry.PortUnavailable)


def test_a_framework_that_is_not_installed_makes_its_port_unavailable(monkeypatch):
    forget_port(monkeypatch, "jax")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "jax" else real(name, *rest))
    with pytest.raises(registry.PortUnavailable, match="jax not installed"):
        registry.load_port("jax")
    assert registry.available_port("jax") is None


@pytest.mark.parametrize("name", registry.PORTS)
def test_every_port_whose_framework_is_installed_loads(name):
    # The [all] install (the development venv) has torch and JAX: each port must import there.
    if registry.missing_packages(name):
        pytest.skip(f"{name}'s framework is not installed here (tools/check_numpy_only.py covers that install)")
    assert registry.load_port(name).NAME == name


def test_numpy_needs_nothing_but_numpy():
    assert registry.missing_packages("numpy") == []


@pytest.mark.parametrize(
    ("name", "package", "release", "refusal"),
    [
        ("jax", "flax", "0.12.0", r"flax 0\.12\.0 is older than 0\.12\.1, which kvports needs \(nnx\.List, Variable"),
        ("torch", "torch", "2.6.0+cu124", r"torch 2\.6\.0\+cu124 is older than 2\.7, .*: pip install 'torch>=2\.7'"),
        ("torch", "torch", "2.7.0+cu126", None),  # a machine's own CUDA build, new enough
    ],
)
def test_a_framework_older_than_the_ports_need_makes_its_port_unavailable_naming_the_release(
    monkeypatch, name, package, release, refusal
):
    if registry.missing_packages(name):
        pytest.skip(f"{name}'s framework is not installed here")
    monkeypatch.setattr(registry, "_loaded", {})
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda wanted: release if wanted == package else real(wanted))
    if refusal is None:
        assert registry.load_port(name).NAME == name
        return
    with pytest.raises(registry.PortUnavailable, match=refusal):
        registry.load_port(name)
