"""Sizes and counts kvports refuses: every count a command takes is bounded below and above (new
tokens, batch, n-gram, top-k, repeats, threads, logprobs, layers, seed), and a run, bench, model
or block pool too large for memory is refused before anything is read or allocated. One `error:`
line naming the value and its bound, the same in every framework; the largest value a bound
allows runs."""

from __future__ import annotations

import dataclasses
import json

import pytest

import kvports
from kvports import generating
from kvports.formats.weights import gpt2_init_weights, save_weights
from kvports.registry import PORTS
from kvports.shared.config import MAX_SIZE
from kvports.shared.generation import GenerationConfig
from kvports.threads import max_threads
from tests.helpers.commands import assert_one_error_line, batch, requests_file, run_cli
from tests.helpers.models import GOLDEN, LONG, SEED, TINY_FAMILIES

# --- runs too large: bounded before anything is allocated -----------------------------------------


@pytest.fixture
def long_model(tmp_path):
    path = tmp_path / "long.safetensors"
    save_weights(path, gpt2_init_weights(LONG), LONG)
    return path


SIZE_CASES = {
    "naive_million_tokens": (
        {},
        ["--mode", "naive", "--new-tokens", "1000000"],
        "would allocate at least 14.6 TiB",
    ),
    "cached_past_the_limit": (
        {"KVPORTS_MAX_BYTES": "1M"},
        ["--mode", "cached", "--new-tokens", "100000"],
        "above the limit of 1.0 MiB (KVPORTS_MAX_BYTES=1M)",
    ),
    "limit_not_a_number": (
        {"KVPORTS_MAX_BYTES": "lots"},
        ["--mode", "cached", "--new-tokens", "5"],
        "KVPORTS_MAX_BYTES='lots' is not a number of bytes",
    ),
    "past_max_seq_len": (
        {},
        ["--mode", "cached", "--new-tokens", str(2**20)],
        "exceeds max_seq_len 1048576",
    ),
}


@pytest.mark.parametrize("case", sorted(SIZE_CASES))
def test_a_run_too_large_is_refused_before_anything_is_read(
    long_model, capsys, monkeypatch, no_port_may_load, no_tensor_may_be_read, case
):
    environment, argv, expected = SIZE_CASES[case]
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    messages = set()
    for framework in PORTS:
        code, out, err = run_cli(capsys, "generate", "--framework", framework, "--weights", long_model, *argv)
        messages.add(assert_one_error_line(code, out, err))
    assert len(messages) == 1 and expected in messages.pop()


BENCH_CASES = {
    "prompt_len_past_max_seq_len": (["--prompt-len", "1000000000"], "prompt length 1000000000 + new tokens 100"),
    "batch_past_the_limit": (["--batch", "100000000"], "would allocate at least"),
    "batch_past_bound": (["--batch", str(2**31)], f"--batch 2147483648 is above {MAX_SIZE}"),
    "batch_with_underscore": (["--batch", "1_0"], "invalid int value: '1_0'"),
    "sweep_with_underscore": (["--sweep", "1_0"], "--sweep value '1_0' is not an integer"),
}


@pytest.mark.parametrize("case", sorted(BENCH_CASES))
def test_a_bench_too_large_is_refused_before_anything_is_read(capsys, no_port_may_load, no_tensor_may_be_read, case):
    argv, expected = BENCH_CASES[case]
    assert expected in assert_one_error_line(*run_cli(capsys, "bench", *argv))


INIT_CASES = {
    "seed_past_64_bits": (["--seed", str(2**64)], "error: --seed 18446744073709551616 is above 18446744073709551615\n"),
    "negative_seed": (["--seed", "-1"], "error: --seed -1 is below 0\n"),
    "zero_layers": (["--n-layers", "0"], "error: --n-layers 0 is below 1\n"),
    "layers_past_bound": (["--n-layers", str(2**31)], f"n_layers=2147483648 must be an integer in [1, {MAX_SIZE}]"),
    "sizes_past_the_limit": (["--vocab-size", str(MAX_SIZE), "--d-model", "65536"], "would allocate at least"),
}


@pytest.mark.parametrize("case", sorted(INIT_CASES))
def test_init_weights_refuses_a_bad_size_or_seed_before_initialising(tmp_path, capsys, no_port_may_load, case):
    argv, expected = INIT_CASES[case]
    err = assert_one_error_line(*run_cli(capsys, "init-weights", "--out", tmp_path / "w.safetensors", *argv))
    assert expected in err


# --- every count has an upper bound ---------------------------------------------------------------


SPECULATIVE = ["--mode", "speculative", "--draft", "ngram"]


# (argv, the one error line)
COUNT_CASES = {
    "huge_ngram": ([*SPECULATIVE, "--ngram", "1000000"], "error: --ngram 1000000 is above 64\n"),
    "ngram_past_the_run": (
        [*SPECULATIVE, "--prompt", "1,2,3", "--new-tokens", "4", "--ngram", "8"],
        "error: --ngram 8 is above prompt length 3 + new tokens 4 = 7, the tokens the run holds\n",
    ),
    "huge_top_k": (["--mode", "cached", "--top-k", str(2**40)], f"error: top-k {2**40} is above {MAX_SIZE}\n"),
}


@pytest.mark.parametrize("framework", PORTS)
@pytest.mark.parametrize("case", sorted(COUNT_CASES))
def test_generate_bounds_every_count_the_same_in_every_port(capsys, no_port_may_load, framework, case):
    argv, expected = COUNT_CASES[case]
    assert assert_one_error_line(*run_cli(capsys, "generate", "--framework", framework, *argv)) == expected


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["compare", "--repeats", str(2**31)], f"error: --repeats {2**31} is above {MAX_SIZE}\n"),
        (["compare", "--draft", "ngram", "--ngram", "65"], "error: --ngram 65 is above 64\n"),
        (
            ["bench", "--modes", "speculative", "--draft", "ngram", "--prompt-len", "3", "--new-tokens", "4"]
            + ["--ngram", "8"],
            "error: --ngram 8 is above prompt length 3 + new tokens 4 = 7, the tokens the run holds\n",
        ),
        (["batch", "--bench", "--count", str(2**31)], f"error: --count {2**31} is above {MAX_SIZE}\n"),
    ],
)
def test_every_command_bounds_its_counts(capsys, no_port_may_load, argv, expected):
    assert assert_one_error_line(*run_cli(capsys, *argv)) == expected


def test_the_longest_ngram_a_run_holds_gives_the_same_tokens_in_every_port(port):
    out = kvports.load(port.NAME).generate(SEED, 3, "speculative", draft="ngram", ngram=len(SEED) + 3)
    assert out.generated == [GOLDEN[:3]]


THREAD_COMMANDS = {
    **{f"generate_{name}": ["generate", "--framework", name, "--mode", "cached"] for name in PORTS},
    "compare": ["compare"],
    "bench": ["bench"],
    "batch": ["batch", "--requests", "absent.jsonl"],
    "batch_bench": ["batch", "--bench"],
}


@pytest.mark.parametrize("value, limit", [("0", "is below 1"), ("1000000", f"is above {max_threads()}")])
@pytest.mark.parametrize("command", sorted(THREAD_COMMANDS))
def test_threads_out_of_range_is_one_error_line_before_any_port_loads(capsys, no_port_may_load, command, value, limit):
    err = assert_one_error_line(*run_cli(capsys, *THREAD_COMMANDS[command], "--threads", value))
    assert err == f"error: --threads {value} {limit}\n"


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--mode", "cached", "--logprobs", "21"], "error: --logprobs 21 is above 20\n"),
        (["--mode", "cached", "--logprobs", "-1"], "error: --logprobs -1 is below 0\n"),
        (
            ["--mode", "speculative", "--draft", "ngram", "--logprobs", "2"],
            "error: --logprobs 2 needs --mode naive or cached: speculative decoding verifies proposals in rounds "
            "and keeps no step's logits\n",
        ),
    ],
)
@pytest.mark.parametrize("framework", PORTS)
def test_logprobs_out_of_bounds_is_one_error_line(capsys, no_port_may_load, framework, argv, expected):
    assert assert_one_error_line(*run_cli(capsys, "generate", "--framework", framework, *argv)) == expected


def test_logprobs_are_bounded_by_the_vocabulary(seed_weights):
    config, _ = seed_weights
    inputs = generating.RunInputs("numpy", "cached", GenerationConfig(2), logprobs=20)
    small = dataclasses.replace(config, vocab_size=8)
    with pytest.raises(generating.UserError, match="--logprobs 20 is above 8"):
        generating.check_inputs(inputs, small, [[1, 2]])


# --- the block pool -------------------------------------------------------------------------------


@pytest.fixture
def long_context(tmp_path):
    """A tiny Llama with a context of 2**26 tokens: a default pool of 32 such sequences is 2**31 slots."""
    config = dataclasses.replace(TINY_FAMILIES["llama"], max_seq_len=2**26).validate()
    weights = tmp_path / "long.safetensors"
    save_weights(weights, gpt2_init_weights(config), config)
    return weights


def test_a_context_too_long_for_the_default_pool_is_told_the_flag_that_sets_it(tmp_path, capsys, port, long_context):
    long_request = json.dumps({"prompt": [1], "max_new_tokens": 2**26 - 1})  # the whole context
    code, out, err = batch(capsys, port, "--requests", requests_file(tmp_path, long_request), "--weights", long_context)
    assert assert_one_error_line(code, out, err) == (
        "error: pool slots (num blocks x block size) 2147483648 is above 1073741824: set a smaller pool with "
        "--num-blocks (by default --max-batch 32 sequences of 67108864 tokens)\n"
    )


def test_the_default_pool_is_sized_for_the_requests_not_the_models_context(tmp_path, capsys, port, long_context):
    code, out, err = batch(
        capsys, port, "--requests", requests_file(tmp_path, '{"prompt": [1]}'), "--weights", long_context
    )
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["summary"]["blocks"]["num_blocks"] == 32 * 2  # 17 tokens: 2 blocks each
