"""The command line itself, misused: a malformed or mistyped command, a bare `kvports`, a number
outside its type, flags that do nothing or cannot go together, a reader that closes the pipe.
One `error:` line (or one `warning:` line, and the run goes on), never a traceback; a closed
pipe ends every command quietly with one exit status."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvports.flags import non_negative_int, positive_int
from kvports.shared.errors import UserError
from tests.helpers.commands import assert_one_error_line, generate, run_cli
from tests.helpers.models import GOLDEN, SEED


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--framework", "tensorflow", "--mode", "cached"],
        ["generate", "--framework", "torch", "--mode", "fast"],
        ["generate", "--framework", "torch", "--mode", "cached", "--new-tokens", "ten"],
        ["generate", "--framework", "torch", "--mode", "cached", "--dtype", "float16"],
        ["generate", "--mode", "cached"],
        ["frobnicate"],
    ],
)
def test_a_malformed_command_line_is_one_error_line_pointing_to_help(capsys, argv):
    err = assert_one_error_line(*run_cli(capsys, *argv))
    assert err.rstrip().endswith("--help)")


def test_a_bare_kvports_prints_the_help_and_exits_2(capsys):
    code, out, err = run_cli(capsys)
    assert (code, out) == (2, "") and err.startswith("usage: kvports") and "generate" in err and "compare" in err


def test_a_mistyped_flag_names_the_nearest_one(capsys, no_port_may_load):
    err = assert_one_error_line(
        *run_cli(capsys, "generate", "--framework", "numpy", "--mode", "cached", "--new-tokes", "5")
    )
    assert "--new-tokes" in err and "(did you mean --new-tokens?)" in err


def test_console_script_prints_no_traceback():
    argv = "generate --framework numpy --mode naive --prompt 1,2,999".split()
    command = [sys.executable, "-m", "kvports.cli", *argv]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "error: token id 999 in prompt 0 is outside [0, 500) (vocab_size 500)\n"


def test_a_user_error_is_one_line_however_it_was_made():
    assert str(UserError("a\nb\r\n  c")) == "a b c"


# --- integers and numbers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["init-weights", "--out", "x.safetensors", "--n-layers", "0"], "error: --n-layers 0 is below 1\n"),
        (["compare", "--new-tokens", "0"], "error: --new-tokens 0 is below 1\n"),
    ],
)
def test_an_integer_outside_its_types_range_is_one_error_line(capsys, no_port_may_load, argv, expected):
    assert assert_one_error_line(*run_cli(capsys, *argv)) == expected


def test_the_integer_types_accept_their_whole_range():
    assert (positive_int("1"), non_negative_int("0"), non_negative_int("7")) == (1, 0, 7)


def test_a_temperature_with_an_underscore_is_refused_as_the_integer_flags_refuse_it(capsys, port):
    assert generate(capsys, port, "--temperature", "1_0").startswith(
        "error: argument --temperature: invalid number: '1_0'"
    )
    assert generate(capsys, port, "--new-tokens", "1_0").startswith("error: argument --new-tokens: invalid int value")


# --- flags that do nothing, flags that cannot go together -----------------------------------------


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


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["--modes", "speculative"],
            "error: --modes speculative needs --draft FILE (a smaller model) or --draft ngram\n",
        ),
        (
            ["--modes", "speculative", "--draft", "ngram"],
            "error: --modes 'speculative' needs naive or cached too: the reference is a run with logits\n",
        ),
        (["--frameworks", "tensorflow"], "error: unknown framework 'tensorflow'; known: torch, jax, numpy\n"),
    ],
)
def test_compare_modes_and_frameworks_refused_in_one_line(capsys, no_port_may_load, argv, expected):
    assert assert_one_error_line(*run_cli(capsys, "compare", *argv)) == expected


# --- a closed pipe --------------------------------------------------------------------------------


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


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly():
    # `kvports generate --stream ... | head -1`: the reader leaves after one line; the writer
    # must stop without a traceback.
    command = [sys.executable, "-m", "kvports.cli", "generate", "--framework", "numpy", "--mode", "cached"]
    process = subprocess.Popen(
        [*command, "--stream", "--new-tokens", "400"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert process.stdout.readline().startswith(b"  step")
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141 and stderr == ""
