"""CPU routes: a kernel built for instructions the CPU lacks is never taken. shared/cpu.py answers
what the CPU has (KVPORTS_CPU=avx2: as a CPU without AVX-512, AMX or AVX-NE-CONVERT would); torch's
bfloat16 linear takes oneDNN's packed route only where the answer is yes, F.linear elsewhere, and
the header and the bench row name the route taken."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import kvports
from kvports.shared import cpu
from tests.helpers.commands import assert_one_error_line, run_cli

WIDE_CPU = frozenset(
    {"sse4_2", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "amx_tile", "avx_ne_convert"}
)
# What a CPU with AVX2 but no AVX-512 looks like to torch itself: oneDNN and ATen dispatch capped there.
AVX2_MACHINE = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


@pytest.fixture
def wide_cpu(monkeypatch):
    monkeypatch.setattr(cpu, "native_flags", lambda: WIDE_CPU)


def test_the_query_answers_with_the_cpus_own_flags(wide_cpu, monkeypatch):
    monkeypatch.delenv(cpu.SWITCH, raising=False)
    assert cpu.has_all("avx512bw", "avx512vl", "avx512dq") and cpu.has_any(("avx_ne_convert",))


def test_the_switch_answers_as_a_cpu_without_avx512_amx_or_avx_ne_convert(wide_cpu, monkeypatch):
    monkeypatch.setenv(cpu.SWITCH, "avx2")
    assert cpu.cpu_flags() == {"sse4_2", "avx2", "fma"}
    assert not cpu.has_any(("avx512bw",), ("amx_tile",), ("avx_ne_convert",))


def test_a_bad_switch_value_is_one_error_line_before_any_port_loads(capsys, monkeypatch, no_port_may_load):
    monkeypatch.setenv(cpu.SWITCH, "avx1024")
    line = assert_one_error_line(*run_cli(capsys, "generate", "--framework", "numpy", "--mode", "cached"))
    assert line == "error: KVPORTS_CPU='avx1024': expected one of native, avx2 (unset means native)\n"


torch = pytest.importorskip("torch")
onednn = pytest.importorskip("kvports.torch_impl.fast.onednn")


def test_bfloat16_never_takes_the_packed_route_where_the_query_says_no(monkeypatch):
    monkeypatch.setenv(cpu.SWITCH, "avx2")

    def refuse(weight):
        raise AssertionError("oneDNN's packed bfloat16 route taken on a CPU that lacks it")

    monkeypatch.setattr(onednn, "packed", refuse)
    model = kvports.load("torch", dtype="bfloat16")
    assert model.loaded.route == "plain"
    assert len(model.generate(new_tokens=4).generated[0]) == 4


@pytest.mark.skipif(not onednn.packed_bfloat16(), reason="this CPU runs no packed bfloat16 linear")
def test_bfloat16_takes_the_packed_route_where_the_cpu_has_it(monkeypatch):
    monkeypatch.delenv(cpu.SWITCH, raising=False)
    packed = []
    real = onednn.packed
    monkeypatch.setattr(onednn, "packed", lambda weight: packed.append(weight.shape) or real(weight))
    model = kvports.load("torch", dtype="bfloat16")
    model.generate(new_tokens=2)
    assert model.loaded.route == "onednn" and packed


def test_both_routes_give_bfloat16_tokens_within_its_distance_of_each_other(monkeypatch):
    runs = {}
    for route in ("native", "avx2"):
        monkeypatch.setenv(cpu.SWITCH, route)
        result = kvports.load("torch", dtype="bfloat16").generate(new_tokens=8, return_logits=True)
        runs[route] = result.logits
    scale = np.abs(runs["native"]).max()
    assert np.abs(runs["native"] - runs["avx2"]).max() <= 0.05 * scale


def test_the_header_names_the_route_each_linear_took(capsys, monkeypatch):
    monkeypatch.setenv(cpu.SWITCH, "avx2")
    code, out, err = run_cli(capsys, "generate", "--framework", "torch", "--mode", "cached", "--dtype", "bfloat16")
    assert code == 0, err
    assert out.startswith("torch cached bfloat16 via plain on the cpu, "), out


def test_a_machine_without_avx512_runs_every_torch_format():
    """Not the switch: torch itself capped at AVX2 (oneDNN and ATen), as on such a CPU, where the packed
    bfloat16 reorder dies ('bf16 path needs the cpu support avx_ne_convert or avx512bw, ...')."""
    script = (
        "import kvports\n"
        "for dtype, quant in (('bfloat16', 'none'), ('bfloat16', 'int8'), ('float32', 'int8')):\n"
        "    model = kvports.load('torch', dtype=dtype, quant=quant)\n"
        "    print(dtype, quant, model.loaded.route, len(model.generate(new_tokens=3).generated[0]))\n"
    )
    environment = {**os.environ, **AVX2_MACHINE}
    environment.pop(cpu.SWITCH, None)
    done = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["bfloat16 none plain 3", "bfloat16 int8 int8pack 3", "float32 int8 int8pack 3"]
