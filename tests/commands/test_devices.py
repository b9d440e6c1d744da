"""`--device {cpu,gpu}` on generate, compare and bench: without a GPU, one `error:` line."""

from __future__ import annotations

import pytest

from kvports import registry
from kvports.devices import device_problem
from tests.helpers.commands import assert_one_error_line, run_cli

GPU_PORTS = [name for name in registry.PORTS if name not in registry.CPU_ONLY]
COMMANDS = {
    "generate torch": ["generate", "--framework", "torch", "--mode", "cached"],
    "generate jax": ["generate", "--framework", "jax", "--mode", "naive"],
    "compare": ["compare", "--new-tokens", "3"],
    "bench": ["bench", "--new-tokens", "2", "--repeats", "1"],
}


@pytest.fixture
def no_gpu(monkeypatch):
    """Every installed GPU-capable port finds no GPU, whatever this machine has."""
    for name in GPU_PORTS:
        port = registry.available_port(name)
        if port is not None:

            def refuse(device, name=name, real=port.resolve_device):
                if device == "gpu":
                    raise RuntimeError(f"{name} finds no GPU")
                return real(device)

            monkeypatch.setattr(port, "resolve_device", refuse)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_device_gpu_without_a_gpu_is_one_error_line(capsys, no_gpu, command):
    argv = COMMANDS[command]
    if argv[0] == "generate" and registry.available_port(argv[2]) is None:
        pytest.skip(f"{argv[2]} is not installed")
    err = assert_one_error_line(*run_cli(capsys, *argv, "--device", "gpu"))
    assert err.startswith("error: --device gpu: ") and "finds no GPU" in err


def test_numpy_on_a_gpu_is_refused_by_name(capsys):
    err = assert_one_error_line(
        *run_cli(capsys, "generate", "--framework", "numpy", "--mode", "cached", "--device", "gpu")
    )
    assert err == "error: --device gpu: numpy runs on the CPU only\n"


def test_bench_of_cpu_only_frameworks_on_a_gpu_is_refused(capsys):
    err = assert_one_error_line(*run_cli(capsys, "bench", "--frameworks", "numpy", "--device", "gpu"))
    assert err == "error: --device gpu: numpy runs on the CPU only\n"


@pytest.mark.parametrize("name", GPU_PORTS)
def test_a_port_without_a_gpu_says_which_build_it_is(name):
    port = registry.available_port(name)
    if port is None:
        pytest.skip(f"{name} is not installed")
    problem = device_problem(port, "gpu")
    if problem is None:
        pytest.skip("this machine has a GPU")
    assert problem.startswith(f"{name} ") and "finds no GPU" in problem and "\n" not in problem


@pytest.mark.parametrize("argv", [COMMANDS["generate torch"], COMMANDS["compare"]])
def test_device_cpu_is_the_default_and_said_in_the_json(capsys, argv):
    if registry.available_port("torch") is None:
        pytest.skip("torch is not installed")
    code, out, _ = run_cli(capsys, *argv, "--json", "--new-tokens", "2")
    assert code == 0 and '"device": "cpu"' in out
