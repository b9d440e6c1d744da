"""Bad input, round three: every count bounded in every command, the API's own argument types,
one exit status for a closed pipe, messages that name the right thing, and what a new user
trips over (a bare `kvports`, a mistyped flag, how fast a run was)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import kvports
from kvports.registry import COMPILES, PORTS
from kvports.shared.config import MAX_SIZE
from tests.helpers.commands import assert_one_error_line, run_cli
from tests.helpers.models import GOLDEN, SEED_PROMPT
from tests.helpers.ports import port_or_skip

SEED = SEED_PROMPT[0].tolist()
SPECULATIVE = ["--mode", "speculative", "--draft", "ngram"]


def api_message(call) -> str:
    with pytest.raises(kvports.UserError) as refusal:
        call()
    return str(refusal.value)


# ---------------------------------------------------------------- every count has an upper bound

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


def test_the_api_bounds_ngram_naming_its_own_argument(port):
    model = kvports.load(port.NAME)
    message = api_message(lambda: model.generate([1, 2, 3], 4, "speculative", draft="ngram", ngram=8))
    assert message == "ngram=8 is above prompt length 3 + new tokens 4 = 7, the tokens the run holds"


def test_the_longest_ngram_a_run_holds_gives_the_same_tokens_in_every_port(port):
    out = kvports.load(port.NAME).generate(SEED, 3, "speculative", draft="ngram", ngram=len(SEED) + 3)
    assert out.generated == [GOLDEN[:3]]


# ---------------------------------------------------------------- the API checks its own arguments' types

LOAD_TYPES = {
    "weights_a_number": (("numpy", 123), {}, "weights=123 is not a path"),
    "framework_a_number": ((5,), {}, "framework=5 is not one of torch, jax, numpy"),
    "model_a_number": (("numpy",), dict(model=5), "model=5 is not a model's name"),
}


@pytest.mark.parametrize("case", sorted(LOAD_TYPES))
def test_load_refuses_an_argument_of_the_wrong_type_by_name(no_port_may_load, case):
    args, keywords, expected = LOAD_TYPES[case]
    assert api_message(lambda: kvports.load(*args, **keywords)) == expected


GENERATE_TYPES = {
    "stop_ids_a_number": (dict(stop_ids=5), "stop_ids=5 is not a list of token ids"),
    "stop_ids_a_string": (dict(stop_ids="12"), "stop_ids='12' is not a list of token ids"),
    "draft_a_number": (dict(mode="speculative", draft=5), "draft=5 is not a path or 'ngram'"),
    "on_token_a_number": (dict(on_token=5), "on_token=5 is not callable"),
    "return_logits_a_string": (dict(return_logits="yes"), "return_logits='yes' is not True or False"),
    "mode_a_number": (dict(mode=3), "mode=3 is not one of naive, cached, speculative"),
    "prompts_a_number": (dict(prompts=5), "prompts=5 is not a prompt: ids, a batch of them, or '1,2,3'"),
    "draft_empty": (
        dict(mode="speculative", draft=""),
        "draft='' is empty: give a smaller model's weights file or 'ngram'",
    ),
}


@pytest.mark.parametrize("case", sorted(GENERATE_TYPES))
def test_generate_refuses_an_argument_of_the_wrong_type_by_name(port, case):
    keywords, expected = GENERATE_TYPES[case]
    model = kvports.load(port.NAME)
    assert api_message(lambda: model.generate(**{"new_tokens": 2, **keywords})) == expected


# ---------------------------------------------------------------- a closed pipe: one exit status


def closed_pipe_status(*argv: str) -> tuple[int, str]:
    """(exit status, stderr) of `kvports ARGV | true`: the reader is gone before the first write.
    (A reader that leaves after one byte would race a command whose whole output fits the pipe's
    buffer in one write: it could finish before the reader left.)"""
    command = [sys.executable, "-m", "kvports.cli", *argv]
    writer = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert writer.stdout is not None and writer.stderr is not None
    writer.stdout.close()  # the pipe's only reader end goes away: every write to it fails
    err = writer.stderr.read().decode()
    return writer.wait(timeout=300), err


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--framework", "numpy", "--mode", "cached", "--prompt", "1,2", "--prompt", "3", "--stream"],
        ["compare", "--new-tokens", "3", "--repeats", "1"],
        ["bench", "--frameworks", "numpy", "--new-tokens", "3", "--repeats", "1", "--prompt-len", "2"],
    ],
)
def test_a_closed_pipe_ends_every_command_quietly_with_one_status(argv):
    from kvports.cli import EXIT_BROKEN_PIPE

    status, err = closed_pipe_status(*argv)
    assert (status, "Traceback" in err) == (EXIT_BROKEN_PIPE, False), err


# ---------------------------------------------------------------- messages that name the right thing


@pytest.mark.parametrize("framework", PORTS)
def test_an_empty_draft_is_called_empty_not_a_folder(capsys, no_port_may_load, framework):
    err = assert_one_error_line(
        *run_cli(capsys, "generate", "--framework", framework, "--mode", "speculative", "--draft", "")
    )
    assert err == "error: --draft '' is empty: give a smaller model's weights file or 'ngram'\n"


@pytest.mark.parametrize(
    "flags, warning",
    [
        (["--mode", "cached", "--top-k", "5"], "warning: --top-k does nothing without --temperature\n"),
        (
            ["--mode", "cached", "--top-k", "5", "--top-p", "0.5"],
            "warning: --top-k and --top-p do nothing without --temperature\n",
        ),
        (["--mode", "cached", "--draft", "ngram"], "warning: --draft does nothing without --mode speculative\n"),
    ],
)
def test_a_flag_that_does_nothing_is_one_warning_line_and_the_run_goes_on(port, capsys, flags, warning):
    code, out, err = run_cli(capsys, "generate", "--framework", port.NAME, "--new-tokens", "2", "--json", *flags)
    assert (code, err) == (0, warning) and json.loads(out)["tokens"] == [SEED + GOLDEN[:2]]


def test_sampling_flags_with_a_temperature_warn_of_nothing(capsys):
    argv = ["--mode", "cached", "--new-tokens", "2", "--json", "--temperature", "0.5", "--top-k", "5", "--top-p", "0.9"]
    code, _, err = run_cli(capsys, "generate", "--framework", "numpy", *argv)
    assert (code, err) == (0, "")


# ---------------------------------------------------------------- what a new user trips over


def test_a_bare_kvports_prints_the_help_and_exits_2(capsys):
    code, out, err = run_cli(capsys)
    assert (code, out) == (2, "") and err.startswith("usage: kvports") and "generate" in err and "compare" in err


def test_a_mistyped_flag_names_the_nearest_one(capsys, no_port_may_load):
    err = assert_one_error_line(
        *run_cli(capsys, "generate", "--framework", "numpy", "--mode", "cached", "--new-tokes", "5")
    )
    assert "--new-tokes" in err and "(did you mean --new-tokens?)" in err


def test_generate_ends_with_time_to_first_token_and_tokens_per_second(port, capsys):
    code, out, err = run_cli(capsys, "generate", "--framework", port.NAME, "--mode", "cached", "--new-tokens", "3")
    assert code == 0 and err.count("\n") == 1
    assert err.startswith("time to first token ") and err.rstrip().endswith(" tokens/s")
    code, out, err = run_cli(
        capsys, "generate", "--framework", port.NAME, "--mode", "cached", "--new-tokens", "3", "--json"
    )
    figures = json.loads(out)
    assert (code, err) == (0, "") and figures["tokens_per_second"] == pytest.approx(3 / figures["seconds"])
    if port.NAME in COMPILES:  # its one compiled loop hands every token over at once: nothing to time
        assert figures["first_token_seconds"] is None
    else:
        assert 0 < figures["first_token_seconds"] <= figures["seconds"]


def test_generate_with_a_compiling_port_keeps_its_compiled_loop(monkeypatch, capsys):
    """Listening for the first token would send JAX to its stepwise loop: without --stream it is not asked to."""
    port = port_or_skip("jax")
    calls = []
    real = port.generate
    monkeypatch.setattr(port, "generate", lambda *a, **k: calls.append(k.get("on_token")) or real(*a, **k))
    code, _, _ = run_cli(capsys, "generate", "--framework", "jax", "--mode", "cached", "--new-tokens", "3")
    assert code == 0 and calls == [None]


def test_the_readme_says_how_to_install_right_after_the_make_commands():
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block_end = readme.index("```\n", readme.index("make test   #")) + 4
    install = readme.index("## Install")
    assert readme[block_end:install].strip() == ""  # the next thing after the two make commands
    section = readme[install : readme.index("\n## ", install + 1)]
    for needed in ("pip install 'kvports[all]'", "--index-url https://download.pytorch.org/whl/cpu", "torch==2.13.0"):
        assert needed in section
    for extra in ("torch", "jax", "hf", "plot", "test"):
        assert f"`{extra}`" in section
