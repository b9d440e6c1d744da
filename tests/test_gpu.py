"""The GPU: tests marked `gpu` hold torch and JAX on a GPU to themselves on the CPU (where no GPU
is here they skip, all of them in one line of `pytest -rs`); and `make gpu-check`
(tools/gpu_check.py), tested on the CPU: its refusal without a GPU, its report and its verdict,
and the whole pipeline through its hidden CPU switch on tiny models."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from kvports import registry
from kvports.batching.engine import BatchSettings, Engine
from kvports.batching.request import Request
from kvports.devices import device_problem
from kvports.shared.generation import GenerationConfig
from tests.helpers.models import TINY_FAMILIES, random_prompts, random_weights
from tests.helpers.ports import port_or_skip
from tools import gpu_check

GPU_PORTS = ("torch", "jax")


@functools.cache
def gpu_problems() -> dict[str, str | None]:
    """Each GPU framework -> why it cannot reach a GPU here (None: it can)."""
    problems: dict[str, str | None] = {}
    for name in GPU_PORTS:
        port = registry.available_port(name)
        problems[name] = registry.not_installed(name) if port is None else device_problem(port, "gpu")
    return problems


def gpu_port_or_skip(name: str):
    """The port, on a machine where it reaches a GPU. Where none does, every gpu test skips with the
    same reason from this line: `pytest -rs` folds them into one."""
    problems = gpu_problems()
    if all(problems.values()):
        pytest.skip("no GPU here (" + "; ".join(f"{n}: {p}" for n, p in problems.items()) + ")")
    if problems[name]:
        pytest.skip(f"{name} does not reach the GPU: {problems[name]}")
    return registry.load_port(name)


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["naive", "cached"])
@pytest.mark.parametrize("family", ["seed", *sorted(TINY_FAMILIES)])
@pytest.mark.parametrize("name", GPU_PORTS)
def test_gpu_tokens_equal_cpu_tokens_at_float64(name, family, mode, seed_weights):
    port = gpu_port_or_skip(name)
    config, tensors = (
        seed_weights if family == "seed" else (TINY_FAMILIES[family], random_weights(TINY_FAMILIES[family]))
    )
    prompts = random_prompts(config.vocab_size, batch=2, length=7, seed=3)  # [2, 7]
    made = {}
    for device in ("cpu", "gpu"):
        model = port.load_model(config, tensors, "float64", device)
        made[device], _ = port.generate(model, prompts, GenerationConfig(16), mode)  # [2, 23]
    np.testing.assert_array_equal(made["gpu"], made["cpu"])


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_PORTS)
def test_the_paged_engine_on_a_gpu_equals_the_one_request_path(name):
    port = gpu_port_or_skip(name)
    config = TINY_FAMILIES["llama"]
    model = port.load_model(config, random_weights(config, seed=4), "float64", "gpu")
    rng = np.random.default_rng(5)
    requests = [
        Request(f"r{i}", tuple(rng.integers(0, config.vocab_size, size=length).tolist()), GenerationConfig(new))
        for i, (length, new) in enumerate([(5, 9), (11, 4), (2, 12), (8, 6)])
    ]
    engine = Engine(port, model, config, BatchSettings(max_batch=4, block_size=4, max_length=32), dtype="float64")
    for request in requests:
        engine.add(request)
    finished = {}
    while not engine.idle:
        finished.update({sequence.request.id: sequence.tokens for sequence in engine.step()})
    for request in requests:
        alone, _ = port.generate(model, np.asarray([request.prompt]), request.generation, "cached")  # [1, P + N]
        assert list(finished[request.id]) == alone[0].tolist(), request.id


@pytest.mark.parametrize("switches", ["torch 2.9's fp32_precision", "allow_tf32, before them"])
def test_torch_turns_tf32_off_on_a_gpu_with_the_switches_its_version_has(switches, monkeypatch):
    import types

    port = port_or_skip("torch")
    switch = types.SimpleNamespace(fp32_precision="tf32", allow_tf32=True)
    cudnn = types.SimpleNamespace(allow_tf32=True)
    if switches.startswith("torch 2.9"):
        cudnn.conv = types.SimpleNamespace(fp32_precision="tf32")
    fake = types.SimpleNamespace(
        cuda=types.SimpleNamespace(is_available=lambda: True),
        backends=types.SimpleNamespace(cuda=types.SimpleNamespace(matmul=switch), cudnn=cudnn),
        device=str,
    )
    monkeypatch.setattr(port, "torch", fake)  # a CUDA build of either age, on any machine
    assert port.resolve_device("gpu") == "cuda"
    if switches.startswith("torch 2.9"):
        assert (switch.fp32_precision, cudnn.conv.fp32_precision) == ("ieee", "ieee")
    else:
        assert (switch.allow_tf32, cudnn.allow_tf32) == (False, False)


# ---------------------------------------------------------------- make gpu-check, on the CPU

FOUND = {"gpu": "Test GPU", "versions": {"torch": "2.13.0", "numpy": "2.4.6"}, "unusable": {}, "frameworks": ("torch",)}


def compare_row(framework: str, device: str, agree: bool = True, explained: bool = True, step=None) -> dict:
    """A row of `kvports compare --json` as it prints one."""
    return {
        "framework": framework,
        "mode": "cached",
        "device": device,
        "available": True,
        "agree": agree,
        "explained": explained,
        "first_divergent_step": step,
        "logits": {"max_abs_diff": 0.0 if agree else 0.5},
        "seconds": 0.01,
    }


def agreement_verdict(dtype: str, gpu_rows: list[dict], cpu_tokens=None) -> tuple[str, int]:
    section = gpu_check.Section("Agreement")
    gpu = {"tokens": [[1, 2, 3]], "rows": gpu_rows}
    gpu_check.agreement_rows(section, "seed", dtype, {"tokens": cpu_tokens or [[1, 2, 3]]}, gpu)
    return gpu_check.build_report(FOUND, [section], "now")


def test_the_check_passes_when_every_gpu_row_agrees_with_the_cpu():
    report, status = agreement_verdict("float64", [compare_row("torch", "gpu"), compare_row("numpy", "cpu")])
    assert status == 0
    assert "every row agrees" in report
    assert "| seed | float64 | torch | cached | gpu | agree | equal | 0.0e+00 | 0.010 |" in report


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_gpu_row_that_differs_fails_the_check_and_is_named(dtype):
    rows = [compare_row("torch", "gpu"), compare_row("jax", "gpu", agree=False, explained=False, step=4)]
    report, status = agreement_verdict(dtype, rows)
    assert status == gpu_check.EXIT_DISAGREE
    assert f"- seed {dtype} jax cached (gpu): tokens DIFFER @ 4, GPU reference vs CPU equal" in report


def test_a_gpu_reference_that_parts_from_the_cpu_fails_at_float64():
    report, status = agreement_verdict("float64", [compare_row("torch", "gpu")], cpu_tokens=[[1, 2, 4]])
    assert status == gpu_check.EXIT_DISAGREE
    assert "GPU reference vs CPU DIFFER" in report


def test_a_float32_near_tie_passes_where_float64_would_fail():
    rows = [compare_row("torch", "gpu"), compare_row("numpy", "cpu", agree=False, explained=True, step=2)]
    assert agreement_verdict("float32", rows, cpu_tokens=[[1, 2, 4]])[1] == 0
    assert agreement_verdict("float64", rows, cpu_tokens=[[1, 2, 4]])[1] == gpu_check.EXIT_DISAGREE


def test_a_framework_that_fails_in_fewer_bits_is_named_and_the_others_rows_still_show(tmp_path):
    def run(argv, timeout):  # kvports compare as a GPU machine whose torch lacks a CUDA kernel would answer
        frameworks = argv[argv.index("--frameworks") + 1]
        if "torch" in frameworks:
            return 1, "", "Traceback (most recent call last):\nNotImplementedError: no CUDA kernel for int8\n"
        row = {"framework": "jax", "mode": "cached", "available": True}
        row["vs_float32"] = {"first_divergent_step": None, "max_abs_diff": 0.02}
        return 0, json.dumps({"rows": [row]}), ""

    models = gpu_check.model_files(gpu_check.Plan(small=True), tmp_path)
    section = gpu_check.reduced_precision(gpu_check.Kvports(1, run), gpu_check.Plan(), GPU_PORTS, models, None)
    assert "| seed | float32+int8 | jax | cached | agree | 2.0e-02 |" in section.lines
    assert "seed float32+int8 torch: exit 1: NotImplementedError: no CUDA kernel for int8" in section.failures
    assert len(section.failures) == 4  # torch, at each of bfloat16 and int8 on both models


def test_a_run_the_time_limit_stops_is_not_run_again_per_framework(tmp_path):
    calls = []

    def run(argv, timeout):
        calls.append(argv)
        return gpu_check.TIMED_OUT, "", f"timed out after {timeout:.0f} s"

    models = gpu_check.model_files(gpu_check.Plan(small=True), tmp_path)
    section = gpu_check.reduced_precision(gpu_check.Kvports(1, run), gpu_check.Plan(), GPU_PORTS, models, None)
    assert len(calls) == 4  # bfloat16 and int8 on both models, each once
    assert len(section.failures) == 4 and all("torch,jax: exit 124: timed out" in line for line in section.failures)


def test_the_speed_table_shows_prefill_figures_the_bench_json_has():
    row = {"framework": "jax", "variant": None, "mode": "cached", "weights": "float32", "device": "gpu"}
    row |= {"available": True, "ttft_ms": 1.5, "pp_tokens_per_s": 9000.0, "decode_ms_per_token": 0.8}
    result = {
        "settings": {"parameters": 1000, "batch": 1, "prompt_len": 5, "new_tokens": 8, "repeats": 3},
        "machine": {"bandwidth_gb_s": {"jax (gpu)": 3000.0}},
        "rows": [row],
    }
    lines = gpu_check.bench_lines("gpt2-small", result)
    assert "| framework | mode | weights | device | ttft ms | pp_tokens_per_s | decode ms/token |" in lines[2]
    assert "| jax | cached | float32 | gpu | 1.50 | 9000.00 | 0.800 |" in lines[4]
    assert lines[0].startswith("**gpt2-small**: 1,000 parameters") and "jax (gpu) 3000 GB/s" in lines[0]


def test_without_a_gpu_the_check_refuses_in_one_line(capsys):
    if not all(gpu_problems().values()):
        pytest.skip("a GPU is here: the check would run")
    assert gpu_check.main([]) == gpu_check.EXIT_NO_GPU
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: make gpu-check needs a GPU: ")
    assert all(f"{name}: " in err for name in GPU_PORTS if not registry.missing_packages(name))


def test_the_check_runs_end_to_end_through_its_cpu_switch(tmp_path, capsys):
    out = tmp_path / "report.md"
    status = gpu_check.main(["--device", "cpu", "--frameworks", "numpy", "--small", "--out", str(out)])
    report = capsys.readouterr().out
    assert status == 0, report
    assert out.read_text() == report
    for title in (
        "Agreement: the GPU against the CPU",
        "Fewer bits on the GPU",
        "Speed: kvports bench",
        "Tests marked gpu",
    ):
        assert f"#### {title}" in report
    assert "| gpt2-small-shaped | float64 | numpy | cached | cpu | agree | equal |" in report
    assert "| seed | bfloat16 | - | - | not offered by numpy | - |" in report
    assert "#### Verdict\n\nevery row agrees" in report
