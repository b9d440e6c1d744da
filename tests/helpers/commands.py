"""Running kvports as a user does: a command in this process (its exit status, stdout and stderr),
the one error line every refusal is, and the processes a command leaves behind."""

from __future__ import annotations

import os
import time

import pytest

from kvports.cli import main


def run_cli(capsys: pytest.CaptureFixture, *argv: object) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `kvports ARGV...`, run in this process."""
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_error_line(code: int, out: str, err: str) -> str:
    """A user error as every command reports one: exit 2, nothing on stdout, one `error:` line; the line."""
    assert (code, out) == (2, ""), (code, out, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err  # one line, no traceback
    return err


def running(pids: list[int], wait: float = 0.0) -> list[int]:
    """The processes of `pids` still running (a zombie, ended but not yet reaped, is not), after
    waiting up to `wait` seconds for them to end."""
    deadline = time.monotonic() + wait
    while True:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                if os.path.exists("/proc"):  # Linux: a zombie answers the signal
                    with open(f"/proc/{pid}/stat") as stat:
                        if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                            continue
            except (ProcessLookupError, FileNotFoundError):
                continue
            alive.append(pid)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)
