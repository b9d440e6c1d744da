"""Running kvports as a user does: a command in this process (its exit status, stdout and stderr),
the one error line every refusal is, and the processes a command leaves behind."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import kvports
from kvports.cli import main
from kvports.registry import PORTS


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


def refusals_in_every_framework(capsys, *argv) -> str:
    """`kvports generate --framework F ARGV...` for every port: one error line, the same for all."""
    messages = {
        assert_one_error_line(*run_cli(capsys, "generate", "--framework", framework, "--mode", "cached", *argv))
        for framework in PORTS
    }
    assert len(messages) == 1, messages
    return messages.pop()


def generate(capsys, port, *argv) -> str:
    """`kvports generate` in this port, refused: its one error line."""
    return assert_one_error_line(*run_cli(capsys, "generate", "--framework", port.NAME, "--mode", "cached", *argv))


def batch(capsys, port, *argv) -> tuple[int, str, str]:
    return run_cli(capsys, "batch", "--framework", port.NAME, *argv)


def requests_file(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def run_batch(capsys, model, tmp_path, lines: list) -> tuple[int, list[dict], str]:
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    argv = ["batch", "--framework", "numpy", "--weights", model, "--requests", requests, "--new-tokens", "3"]
    code, out, err = run_cli(capsys, *argv)
    return code, [json.loads(line) for line in out.splitlines()], err


def api_message(call) -> str:
    with pytest.raises(kvports.UserError) as refusal:
        call()
    return str(refusal.value)


# --- processes -------------------------------------------------------------------------------


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
