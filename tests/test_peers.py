"""`kvports bench --peers`: the llama.cpp and CTranslate2 rows, what they say when their
packages are absent, and the F16/F32 GGUF files kvports writes for llama.cpp. Never timings;
the suite never needs the packages (the llama.cpp agreement test skips without them)."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from kvports.bench.rows import agree_steps
from kvports.bench.runners import PEERS_MISSING
from kvports.formats.gguf.reader import open_reader
from kvports.formats.gguf.writer import NOT_COPIED, cached_gguf, write_gguf
from kvports.formats.weights import open_weights
from tests.helpers.agreement import assert_same_tensors, assert_tokens_agree
from tests.helpers.commands import run_cli
from tests.helpers.gguf_files import write_gguf as write_source_gguf
from tests.helpers.ports import port_or_skip

PEERS = [
    ("llama.cpp", None),
    ("llama.cpp", "F16"),
    ("llama.cpp", "F32"),
    ("ctranslate2", "float32"),
    ("ctranslate2", "int8"),
]
ARGV = ["bench", "--new-tokens", "2", "--repeats", "1", "--frameworks", "numpy", "--modes", "cached", "--peers"]


@pytest.fixture
def peers_absent(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("llama_cpp", "ctranslate2") else real(name, *a)
    )


def test_absent_peers_get_rows_that_say_how_to_install_them(capsys, peers_absent):
    code, out, _ = run_cli(capsys, *ARGV, "--json")
    rows = json.loads(out)["rows"]
    assert code == 0
    assert [(row["framework"], row["variant"], row["available"]) for row in rows] == [("numpy", None, True)] + [
        (framework, variant, False) for framework, variant in PEERS
    ]
    assert all(row["reason"] == PEERS_MISSING and row["ttft_ms"] is None for row in rows[1:])
    assert "pip install 'kvports[peers]'" in PEERS_MISSING
    assert rows[0]["agree_steps"] == 2 and rows[1]["agree_steps"] is None


def test_absent_peers_keep_every_number_column_of_the_table(capsys, peers_absent):
    code, out, _ = run_cli(capsys, *ARGV)
    peer_lines = [line for line in out.splitlines() if line.startswith(("│ llama.cpp", "│ ctranslate2"))]
    assert code == 0 and len(peer_lines) == len(PEERS)
    for line in peer_lines:
        cells = [cell.strip() for cell in line.strip("│").split("│")]
        assert cells[2:-1] == ["-"] * (len(cells) - 3)  # every number column intact, none holding text
        assert cells[-1].startswith("unavailable: not installed (pip install")
    assert "agree" in out.splitlines()[2]  # the agreement column's header


def test_agree_steps_counts_the_leading_new_tokens_equal_in_every_row():
    reference = np.array([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]])  # [B, P + N], P = 2
    assert agree_steps(reference, reference, 2) == 3
    assert agree_steps(np.array([[1, 2, 3, 9, 5], [1, 2, 3, 4, 5]]), reference, 2) == 1
    assert agree_steps(np.array([[1, 2, 3, 4, 5], [1, 2, 8, 4, 5]]), reference, 2) == 0


def test_llama_cpp_on_weights_that_are_not_gguf_says_why(capsys):
    pytest.importorskip("llama_cpp")
    code, out, _ = run_cli(capsys, *ARGV, "--json")
    row = next(row for row in json.loads(out)["rows"] if row["framework"] == "llama.cpp")
    assert code == 0 and not row["available"]
    assert row["reason"] == "ValueError: llama.cpp runs a GGUF file: give --weights FILE.gguf or --model smollm2"


def read_tensors(path):
    with open_weights(path) as file:
        return file.config, file.read("float32")


def copied_fields(path) -> dict:
    reader = open_reader(path)
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


@pytest.mark.parametrize("tie", [True, False])
def test_written_f32_gguf_reads_back_to_the_same_tensors_and_metadata(tmp_path, tie):
    source = write_source_gguf(tmp_path / "source.gguf", "F32", tie=tie)
    config, tensors = read_tensors(source)
    written = write_gguf(tmp_path / "written.gguf", config, tensors, source, "f32")
    written_config, written_tensors = read_tensors(written)
    assert written_config == config
    assert_same_tensors(tensors, written_tensors)  # q/k permuted on the way out, unpermuted on the way in
    expected = {key: value for key, value in copied_fields(source).items() if key not in NOT_COPIED}
    fields = copied_fields(written)
    assert {key: fields[key] for key in expected} == expected  # the tokenizer and template with the rest
    assert fields["general.file_type"] == 0  # llama.cpp's ALL_F32


def test_written_f16_gguf_rounds_matrices_to_float16_and_keeps_norms(tmp_path):
    source = write_source_gguf(tmp_path / "source.gguf", "F32")
    config, tensors = read_tensors(source)
    _, written = read_tensors(write_gguf(tmp_path / "written.gguf", config, tensors, source, "f16"))
    rounded = {name: a if a.ndim == 1 else a.astype(np.float16).astype(np.float32) for name, a in tensors.items()}
    assert_same_tensors(rounded, written)
    assert not np.array_equal(written["blocks.0.qkv.weight"], tensors["blocks.0.qkv.weight"])


def test_cached_gguf_is_written_once_under_kvports_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPORTS_HOME", str(tmp_path / "home"))
    source = write_source_gguf(tmp_path / "source.gguf", "F32")
    config, tensors = read_tensors(source)
    path = cached_gguf(source, config, tensors, "f16")
    first = path.stat().st_mtime_ns
    assert path.parent == tmp_path / "home" / "gguf" and path.name.endswith(".f16.gguf")
    assert cached_gguf(source, config, tensors, "f16") == path and path.stat().st_mtime_ns == first
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp file left beside it


def test_llama_cpp_greedy_tokens_on_a_written_f32_model_equal_float32_ports(tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp")
    from kvports.baselines import llama_cpp

    monkeypatch.setenv("KVPORTS_HOME", str(tmp_path / "home"))
    source = write_source_gguf(tmp_path / "source.gguf", "Q8_0", tie=False)  # F32 written from dequantized Q8_0
    config, tensors = read_tensors(source)
    prompts = np.array([[5, 17, 42, 99, 7]])  # [1, P]
    numpy_port = port_or_skip("numpy")
    reference, logits = numpy_port.generate(
        numpy_port.load_model(config, tensors), prompts, 24, "cached", return_logits=True
    )
    model = llama_cpp.load_model(config, tensors, source=source, threads=1, weights="f32")
    assert model.weights == "F32"
    tokens, _ = llama_cpp.generate(model, prompts, 24)
    assert_tokens_agree(reference, logits, tokens, prompts.shape[1], "llama.cpp F32")


def test_the_peers_report_gives_one_line_per_engine_and_weight_format_of_one_run(capsys, peers_absent):
    from tools import peers_report

    port_or_skip("torch")
    argv = [*ARGV, "--frameworks", "torch,numpy", "--quant", "none,int8", "--threads", "1", "--json"]
    code, out, _ = run_cli(capsys, *argv)
    table = [line for line in peers_report.markdown([json.loads(out)]).splitlines() if line.startswith("|")]
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in table[2:]]  # past header and rule
    expected = [["torch", "float32", "llama.cpp F32"], ["torch", "float32+int8", "ctranslate2 int8"]]
    assert code == 0 and [line[:3] for line in cells] == [*expected, ["numpy", "float32", "llama.cpp F32"]]
    assert table[0].split(" | ")[3:5] == ["pp511 tok/s, 1 thr", "tg2 tok/s, 1 thr"]  # the seed model's longest prompt


def test_the_peers_report_lists_each_peer_target_met_or_missed_at_each_thread_count():
    from tools import peers_report

    tg = "numpy float32 tg, x the time per token of llama.cpp F32"
    targets = [
        {"target": tg, "threads": 1, "value": 1.0012, "threshold": 1.0, "met": False},
        {"target": tg, "threads": 2, "value": 0.9, "threshold": 1.0, "met": True},
        {"target": "torch float32+q4 (the best 4-bit row) tg", "threads": 2, "value": 1.5, "met": False},
        {"target": "seed-size decode, x faster than seed-concat", "value": 3.0, "threshold": 2.0, "met": True},
    ]
    assert peers_report.targets_table([{"targets": targets}], [1, 2])[1:] == [
        "| target | 1 thr | 2 thr |",
        "|---|---|---|",
        f"| {tg} | 1.001x, missed | 0.900x, met |",  # a miss by a thousandth still reads as a miss
        "| torch float32+q4 (the best 4-bit row) tg | - | 1.500x, missed |",  # a best row at one count only
    ]
    assert peers_report.targets_table([{"targets": targets[3:]}], [1]) == []  # no peer ran: no table
