"""`kvports bench --serve`: its flags checked before any server starts, and its figures as a row
(requests/s, tokens/s, latency percentiles, prefix hits, the engine's share of the time)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvports.bench.serving import row_of
from tests.helpers.commands import assert_one_error_line, run_cli

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "--serve sends chat requests: give --model NAME or --weights FILE.gguf"),
        (["--weights", "{model}", "--batch", "2"], "--serve runs its own request set, which takes no --batch"),
        (["--weights", "{model}", "--frameworks", "transformers"], "--serve serves the ports (torch,jax,numpy)"),
        (["--weights", "{model}", "--threads", "1,2"], "--serve runs its servers at one thread count, not --threads"),
    ],
)
def test_bench_serve_refuses_what_it_does_not_run_in_one_line(capsys, chat_model, argv, message):
    argv = [str(chat_model) if part == "{model}" else part for part in argv]
    err = assert_one_error_line(*run_cli(capsys, "bench", "--serve", *argv))
    assert message in err


def test_a_row_is_the_clients_timings_and_the_servers_counters():
    results = [
        {"ttft": 0.5, "gaps": [0.1, 0.1, 0.3], "tokens": 4, "latency": 1.0},
        {"ttft": 1.5, "gaps": [0.2], "tokens": 2, "latency": 1.7},
    ]
    before = {"cached": 10, "prefill": 50, "prefill_s": 1.0, "decode_s": 2.0, "decode_steps": 4, "generated": 0}
    after = {"cached": 40, "prefill": 110, "prefill_s": 1.5, "decode_s": 3.0, "decode_steps": 9, "generated": 6}
    row = row_of("kvports numpy", 2, results, 2.0, before, after)
    assert (row["requests_per_s"], row["output_tokens_per_s"]) == (1.0, 3.0)
    assert row["ttft_p50_s"] == 1.0 and row["itl_p50_s"] == pytest.approx(0.15)
    assert row["prefix_hit_rate"] == pytest.approx(30 / 90)  # 30 cached of the 90 the prompts needed
    assert row["decode_ms_per_step"] == pytest.approx(200.0) and row["engine_busy"] == pytest.approx(0.75)
    assert row_of("llama.cpp server", 2, results, 2.0, {}, {})["prefix_hit_rate"] is None


@pytest.mark.parametrize("name", ["serving_smollm2_t2.json", "serving_smollm2_idle.json"])
def test_serving_md_table_is_the_committed_run(name):
    from kvports.bench.serving import table

    run = json.loads((DOCS / "data" / name).read_text())
    assert table(run) in (DOCS / "SERVING.md").read_text(), "paste kvports.bench.serving.table(the run) into it"
