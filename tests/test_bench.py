"""`kvports bench`: its JSON schema, CSV, plots, errors and the two baselines. Never timings:
only that every time is a positive number and every size is the one the config implies."""

from __future__ import annotations

import contextlib
import importlib
import io
import json

import numpy as np
import pytest

from kvports.shared import cli, ports
from kvports.shared.bench.measure import decode_bytes, fit_slope
from kvports.shared.bench.presets import PRESETS, random_weights
from kvports.shared.bench.runners import RUNNERS
from kvports.shared.config import ModelConfig, kv_cache_bytes
from kvports.shared.weights import load_weights
from tests.helpers import GOLDEN, SEED_PROMPT, assert_one_error_line, run_cli

NEW_TOKENS = 4
ROW_FIELDS = {
    "framework",
    "mode",
    "ttft_ms",
    "decode_ms_per_token",
    "decode_ms_p90",
    "tokens_per_s",
    "total_s",
    "compile_s",
    "kv_cache_bytes",
    "roofline_ratio",
    "per_step_ms",
}


def baseline_or_skip(name: str):
    try:
        return importlib.import_module(f"kvports.baselines.{name}")
    except ImportError as exc:
        pytest.skip(f"baselines.{name} needs a missing package ({exc})")


QUICK = ("torch", "numpy", "seed-concat")  # no compile, no heavy import: the quick run takes seconds
SLOW = ("jax", "transformers")  # JAX compiles seven programs, transformers takes seconds to import


def run_bench(folder, frameworks, *extra):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # a module-scoped fixture has no capsys
        code = cli.main(
            [
                "bench",
                "--json",
                "--new-tokens",
                str(NEW_TOKENS),
                "--repeats",
                "2",
                "--frameworks",
                ",".join(frameworks),
                "--plot",
                str(folder),
                *extra,
            ]
        )
    assert code == 0
    return json.loads(out.getvalue()), folder


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(QUICK, id="quick"),
        pytest.param(SLOW, id="jax-transformers", marks=pytest.mark.slow),
    ],
)
def bench_run(request, tmp_path_factory):
    """A small run, with the roofline, a sweep and plots."""
    return run_bench(tmp_path_factory.mktemp("bench") / "img", request.param, "--roofline", "--sweep", "2,4")


def test_bench_json_has_settings_machine_and_a_row_per_framework_and_mode(bench_run):
    result, _ = bench_run
    assert {"settings", "machine", "rows"} <= set(result)
    settings = result["settings"]
    assert (settings["batch"], settings["prompt_len"], settings["new_tokens"]) == (1, 5, NEW_TOKENS)
    assert settings["dtype"] == "float32" and settings["device"] == "cpu" and "numpy" in settings["versions"]
    frameworks = {row["framework"] for row in result["rows"]}
    expected = [
        (runner.framework, mode) for runner in RUNNERS if runner.framework in frameworks for mode in runner.modes
    ]
    assert [(row["framework"], row["mode"]) for row in result["rows"]] == expected
    assert frameworks in (set(QUICK), set(SLOW))
    assert result["machine"]["bandwidth_gb_s"]["numpy (cpu)"] > 0


def test_every_available_row_has_positive_times_and_one_step_per_token(bench_run):
    result, _ = bench_run
    for row in (row for row in result["rows"] if row["available"]):
        label = f"{row['framework']} {row['mode']}"
        assert ROW_FIELDS <= set(row), label
        for field in ("ttft_ms", "decode_ms_per_token", "decode_ms_p90", "tokens_per_s", "total_s", "roofline_ratio"):
            assert row[field] > 0, f"{label}: {field}"
        assert len(row["per_step_ms"]) == NEW_TOKENS and min(row["per_step_ms"]) > 0, label
        assert row["decode_ms_p90"] >= row["decode_ms_per_token"], label
        assert len(row["repeats"]) == 2 and all(r["stream_tokens_equal"] for r in row["repeats"]), label
        assert (row["compile_s"] is not None) == (row["framework"] == "jax"), label  # JAX alone compiles
        assert row["compile_s"] is None or row["compile_s"] >= 0, label
        assert row["sweep"]["new_tokens"] == [2, 4] and min(row["sweep"]["total_s"]) > 0, label


def test_every_row_generates_the_seed_golden_tokens(bench_run):
    result, _ = bench_run
    for row in (row for row in result["rows"] if row["available"]):
        assert row["tokens_agree"], f"{row['framework']} {row['mode']} differs from {row['tokens_reference']}"


def test_kv_cache_bytes_are_the_configs(bench_run):
    result, _ = bench_run
    config = ModelConfig.from_dict(result["settings"]["config"])
    total = 5 + NEW_TOKENS
    for row in (row for row in result["rows"] if row["available"]):
        if row["mode"] == "naive":
            expected = 0
        elif row["framework"] in ("seed-concat", "transformers"):
            expected = kv_cache_bytes(config, 1, total - 1, 4)  # grown: the last token is never fed back
        else:
            expected = kv_cache_bytes(config, 1, total, 4)  # preallocated for prompt + new tokens
        assert row["kv_cache_bytes"] == expected, f"{row['framework']} {row['mode']}"


def test_a_framework_that_is_not_installed_gets_rows_that_say_why(capsys, monkeypatch):
    real = ports.load_port

    def no_jax(name):
        if name == "jax":
            raise ports.PortUnavailable(name, "No module named 'jax'")
        return real(name)

    monkeypatch.setattr(ports, "load_port", no_jax)
    code, out, _ = run_cli(
        capsys, "bench", "--json", "--new-tokens", "2", "--repeats", "1", "--frameworks", "jax,numpy"
    )
    rows = json.loads(out)["rows"]
    assert code == 0
    assert [(row["framework"], row["available"]) for row in rows] == [("jax", False)] * 2 + [("numpy", True)] * 2
    assert all(row["reason"] == "No module named 'jax'" for row in rows[:2])
    assert all(set(row) >= ROW_FIELDS and row["ttft_ms"] is None for row in rows[:2])  # every field, empty


def test_plots_are_written_as_png(bench_run):
    pytest.importorskip("matplotlib")
    result, folder = bench_run
    names = sorted(path.name for path in folder.iterdir())
    assert names == ["per_step_seed.png", "total_vs_tokens_seed.png"]  # no temp files left behind
    assert all(path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for path in folder.iterdir())
    assert sorted(result["plots"]) == sorted(str(folder / name) for name in names)


def test_csv_is_a_header_and_one_line_per_row(capsys):
    code, out, _ = run_cli(capsys, "bench", "--csv", "--new-tokens", "2", "--repeats", "1", "--frameworks", "numpy")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 3
    assert lines[0].startswith("preset,batch,prompt_len,new_tokens,framework,variant,mode")
    assert lines[1].startswith("seed,1,5,2,numpy,,naive,True")


def test_table_is_printed_without_json(capsys):
    code, out, _ = run_cli(
        capsys, "bench", "--new-tokens", "2", "--repeats", "1", "--frameworks", "numpy", "--modes", "cached"
    )
    assert code == 0 and "kvports bench: seed" in out and "numpy" in out and "cached" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--new-tokens", "1"], "error: new tokens 1 is below 2"),
        (["--new-tokens", "600"], "error: prompt length 5 + new tokens 600 = 605 exceeds max_seq_len 512"),
        (["--frameworks", "tensorflow"], "error: unknown framework 'tensorflow'"),
        (["--modes", "speculative"], "error: unknown mode 'speculative'"),
        (["--repeats", "0"], "error: --repeats 0 is below 1"),
        (["--warmup", "0"], "error: --warmup 0 is below 1"),
        (["--sweep", "2,x"], "error: --sweep value 'x' is not an integer"),
        (["--sweep", "600"], "error: --sweep value 600 + prompt length 5 exceeds max_seq_len 512"),
        (["--plot", "/no/such/folder/img"], "error: folder '/no/such/folder' does not exist"),
    ],
)
def test_bad_bench_input_is_one_error_line(capsys, argv, message):
    assert assert_one_error_line(*run_cli(capsys, "bench", "--frameworks", "numpy", *argv)).startswith(message)


def test_gpu_rows_without_a_gpu_are_unavailable_not_a_crash(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, out, _ = run_cli(
        capsys,
        "bench",
        "--json",
        "--device",
        "gpu",
        "--new-tokens",
        "2",
        "--repeats",
        "1",
        "--frameworks",
        "torch,numpy",
    )
    rows = json.loads(out)["rows"]
    assert code == 0
    assert [(row["framework"], row["available"]) for row in rows] == [("torch", False)] * 2 + [("numpy", True)] * 2
    assert all(row["device"] == "cpu" for row in rows if row["available"])  # NumPy stays on the CPU


def test_baseline_on_token_reports_each_token(seed_weights):
    baseline = baseline_or_skip("seed_concat")
    config, tensors = seed_weights
    streamed = []
    tokens, _ = baseline.generate(
        baseline.load_model(config, tensors), SEED_PROMPT, 3, "cached", on_token=streamed.append
    )
    assert np.stack(streamed, axis=1).tolist() == [GOLDEN[:3]] and tokens[0, 5:].tolist() == GOLDEN[:3]


@pytest.mark.parametrize("name", ["seed_concat", "hf_gpt2"])
def test_baseline_reproduces_the_seed_golden_tokens(seed_weights, name):
    baseline = baseline_or_skip(name)
    config, tensors = seed_weights
    model = baseline.load_model(config, tensors)
    tokens, _ = baseline.generate(model, SEED_PROMPT, 100, "cached")
    assert tokens[0, 5:].tolist() == GOLDEN


def test_gpt2_mapping_names_every_parameter_once(seed_weights):
    hf_gpt2 = baseline_or_skip("hf_gpt2")
    config, tensors = seed_weights
    state = hf_gpt2.gpt2_hf_tensors(config, tensors)
    model = hf_gpt2.GPT2LMHeadModel(hf_gpt2.gpt2_config(config, "float32"))
    assert set(state) == {name for name, _ in model.named_parameters()}
    assert tuple(state["transformer.h.0.attn.c_attn.weight"].shape) == (config.d_model, 3 * config.d_model)  # (in, out)


def test_decode_bytes_count_weights_once_and_the_cache_so_far():
    config = ModelConfig(vocab_size=10, d_model=4, n_heads=2, n_layers=1, max_seq_len=8)
    tensors = random_weights(config)
    table_bytes = (10 + 8) * 4 * 4  # emb and pos: only one looked-up row each is read
    weights = sum(array.nbytes for array in tensors.values()) - table_bytes + 2 * 4 * 4
    kv_per_position = 2 * 1 * 2 * 2 * 4  # k and v, 1 layer, 2 heads, head_dim 2, float32
    # prompt 2, 3 new tokens: decode steps 1 and 2 see 3 and 4 positions, 3.5 on average
    assert decode_bytes(config, tensors, 1, 2, 3, 4) == weights + 3.5 * kv_per_position


def test_fit_slope_recovers_a_power_law():
    n = [8, 16, 32, 64]
    assert fit_slope(n, [0.001 * value**2 for value in n]) == pytest.approx(2.0)
    assert fit_slope([8], [1.0]) is None


def test_gpt2_small_preset_has_gpt2_small_sizes():
    config = PRESETS["gpt2-small"]
    assert (config.d_model, config.n_layers, config.n_heads, config.vocab_size, config.max_seq_len) == (
        768,
        12,
        12,
        50257,
        1024,
    )
    assert load_weights()[0] == ModelConfig()  # and the seed preset is the shipped seed model
