"""`kvports check` runs the implementation in a child process: however the implementation ends
or misbehaves (an exit, an interrupt, a hang, a huge allocation, writes to file descriptor 1),
the command gives a verdict and a non-zero exit status, and --json's stdout stays one object."""

from __future__ import annotations

import json

import pytest

from tests.helpers.checker import ADAPTER, command_json, variant
from tests.helpers.commands import assert_one_error_line, run_cli

STEP = "def step(model, tokens, state):\n"
FULL = "def full(model, tokens):\n"

# What a cached call after the prefill does instead of returning, and what the report then says.
LATER_STEP = {
    "os._exit": ("import os; os._exit(0)", "FAIL", "ended the process (exit status 0)"),
    "sys.exit": ("import sys; sys.exit(0)", "FAIL", "raised SystemExit"),
    "KeyboardInterrupt": ("raise KeyboardInterrupt", "FAIL", "raised KeyboardInterrupt"),
    "a hang": ("import time; time.sleep(600)", "TIMEOUT", "did not return within 1 s"),
    "a huge allocation": ("import numpy; numpy.ones(1 << 50)", "FAIL", "raised MemoryError"),
}


def misbehaving(tmp_path, where: str, code: str):
    return variant(tmp_path, ADAPTER, where, f"{where}    if state is not None:\n        {code}\n")


@pytest.mark.parametrize("case", LATER_STEP)
def test_an_implementation_that_ends_or_hangs_in_a_call_gets_a_verdict_and_exit_1(capsys, tmp_path, case):
    code, status, words = LATER_STEP[case]
    exit_status, report = command_json(capsys, misbehaving(tmp_path, STEP, code), "--quick", "--timeout", "1")
    assert (exit_status, report["ok"]) == (1, False)
    rows = [check for check in report["checks"] if check["status"] == status]
    assert rows and words in rows[0]["detail"] + " " + " ".join(report["explanations"]), report
    assert "cache_update" not in report["diagnoses"]  # an exit is no cache mistake, even after the prefill


@pytest.mark.parametrize(
    "code, words",
    [
        ("import os; os._exit(3)", "ended the process (exit status 3)"),
        ("while True: pass", "did not return within 1 s"),
    ],
)
def test_an_implementation_that_ends_or_hangs_on_import_is_one_error_line(capsys, tmp_path, code, words):
    path = tmp_path / "impl.py"
    path.write_text(code + "\n" + ADAPTER.read_text())
    err = assert_one_error_line(*run_cli(capsys, "check", path, "--timeout", "1"))
    assert f"import impl.py {words}" in err, err


def test_what_the_implementation_writes_goes_to_stderr_and_json_stays_one_object(capsys, tmp_path):
    # From Python (print) and as native code would (a write to file descriptor 1).
    writes = 'import os; os.write(1, b"written to fd 1\\n"); print("printed")\n'
    path = variant(tmp_path, ADAPTER, FULL, FULL + "    " + writes)
    code, out, err = run_cli(capsys, "check", path, "--quick", "--json")
    assert code == 0 and json.loads(out)["ok"]
    assert "written to fd 1" in err and "printed" in err


def test_nested_lists_are_taken_as_the_logits_they_hold(capsys, tmp_path):
    path = variant(
        tmp_path,
        ADAPTER,
        "    return model.forward(tokens, None)\n",
        "    return model.forward(tokens, None).tolist()\n",
    )
    code, report = command_json(capsys, path, "--quick")
    assert (code, report["ok"]) == (0, True)


def test_the_timeout_must_be_a_positive_number_of_seconds(capsys):
    err = assert_one_error_line(*run_cli(capsys, "check", ADAPTER, "--timeout", "0"))
    assert "--timeout" in err and "0 is not above 0" in err


def test_the_rows_decided_before_the_process_ended_are_kept(capsys, tmp_path):
    # It ends the process in the batch run, the last of --quick: every row before it stands.
    batch_exit = variant(
        tmp_path, ADAPTER, STEP, STEP + "    if tokens.shape[0] > 1:\n        import os; os._exit(0)\n"
    )
    code, report = command_json(capsys, batch_exit, "--quick")
    names = [check["name"] for check in report["checks"]]
    assert code == 1 and names[-1] == "step returns" and report["checks"][-1]["status"] == "FAIL"
    assert "cached == full float32, P=5 + 15 steps" in names and "full logits float32, T=16, batch 3" in names
