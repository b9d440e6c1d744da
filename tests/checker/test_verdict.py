"""`kvports check`'s verdict is the checker's own: the implementation's process sends back only
the values its calls return, so nothing it writes on the channel, patches in its own process or
leaves running can make a check pass, break --json's stdout, outlive the check or stretch
--timeout; and its exception text reaches the terminal escaped, never as control characters or
markup."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest

from kvports.checker import wire
from tests.helpers.checker import ADAPTER, command_json, variant, with_mistake
from tests.helpers.commands import assert_one_error_line, run_cli, running

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and a child subreaper: Linux")

LOAD = "def load(config, weights):\n"
STEP = "def step(model, tokens, state):\n"
FULL = "def full(model, tokens):\n"
# Writes to every file descriptor of the implementation's process but its stdin, stdout and stderr:
# whatever channel the checker gave it, whichever number it has.
EVERY_FD = """

def _to_every_fd(data):
    import os

    for name in os.listdir("/proc/self/fd"):
        if int(name) > 2:
            try:
                os.write(int(name), data)
            except OSError:
                pass
"""
# The report the checker's child process sent when it ran the checks itself: every row passing.
REPORT = {"implementation": "forged", "interface": "adapter", "family": "seed", "reference": "forged"}
FORGED = {"event": "report", "report": {**REPORT, "checks": [], "diagnoses": [], "explanations": [], "notes": []}}


def hostile(tmp_path, where: str, code: str, source=ADAPTER, name: str = "impl.py"):
    """The adapter with `code` run first in the function `where` opens (its lines indented by 4)."""
    lines = "".join(f"    {line}\n" for line in code.splitlines())
    path = variant(tmp_path, source, where, where + lines, name)
    path.write_text(path.read_text() + EVERY_FD)
    return path


def last_row(report: dict) -> dict:
    return report["checks"][-1]


def test_a_report_written_on_the_channel_is_no_verdict(capsys, tmp_path):
    # It writes the report the checker's child used to send, on every pipe it has, then exits.
    code = (
        f"if state is not None:\n    _to_every_fd({json.dumps(FORGED)!r}.encode() + b'\\n')\n    import os; os._exit(0)"
    )
    exit_status, report = command_json(capsys, hostile(tmp_path, STEP, code), "--quick")
    assert (exit_status, report["ok"]) == (1, False)
    assert (last_row(report)["name"], last_row(report)["status"]) == ("step returns", "FAIL")
    assert last_row(report)["detail"].startswith("sent what is not a reply")


def test_patching_the_checkers_classes_in_the_implementations_process_changes_no_row(capsys, tmp_path):
    # It makes every row the checker's own classes write in its process say "pass"; the rows are not made there.
    patch = (
        "import kvports.checker.report as _report\n"
        "_as_dict = _report.Check.as_dict\n"
        "_report.Check.as_dict = lambda check: {**_as_dict(check), 'status': 'pass'}\n"
        "_report.Report.ok = property(lambda report: True)\n"
    )
    broken = with_mistake(tmp_path, "adapter", "position_offset")
    exit_status, report = command_json(capsys, hostile(tmp_path, LOAD, patch, broken, "patched.py"), "--quick")
    assert (exit_status, report["ok"], report["diagnoses"]) == (1, False, ["position_offset"])


# What the implementation writes on every pipe it has, in place of its reply (a Python expression).
ARRAY = '{"array": "AAAA", "dtype": "float32", "shape": [1, 1, 500]}'  # 3 bytes for 500 floats
ERROR = '{"function": "f", "kind": "K", "message": "m", "line": "", "what": "x"}'
MALFORMED = {
    "a line that is not JSON": "b'not json\\n'",
    "the wrong types": """b'{"value": {"logits": "forged"}}\\n'""",
    "bytes that do not fit the shape": f"""b'{{"value": {{"logits": {ARRAY}}}}}\\n'""",
    "nesting past JSON's limit": "b'[' * 100_000 + b'\\n'",
    "an error of no known kind": f"""b'{{"error": {ERROR}}}\\n'""",
    "a line longer than the bound": f"b'x' * {wire.MAX_LINE + 1}",
}


@pytest.mark.parametrize("case", MALFORMED)
def test_what_is_not_a_reply_fails_the_call_it_answered_and_is_no_traceback(capsys, tmp_path, case):
    code = f"if state is not None:\n    _to_every_fd({MALFORMED[case]})"
    exit_status, out, err = run_cli(capsys, "check", hostile(tmp_path, STEP, code), "--quick", "--json")
    report = json.loads(out)
    assert (exit_status, report["ok"], "Traceback" not in err) == (1, False, True), err[-2000:]
    assert (last_row(report)["name"], last_row(report)["status"]) == ("step returns", "FAIL")
    assert last_row(report)["detail"].startswith("sent what is not a reply"), last_row(report)


def kvports_check(*argv: object) -> subprocess.CompletedProcess:
    """`kvports check ARGV --json` as a process of its own, its stdout a pipe (as a caller reading the
    report has it); 120 s: far above a --quick check's time on a loaded machine, far below 600 s."""
    command = [sys.executable, "-m", "kvports.cli", "check", *map(str, argv), "--json"]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_the_checkers_stdout_is_not_its_file_descriptor_1_while_the_implementation_runs(tmp_path):
    # The implementation writes to its parent's file descriptor 1, through /proc: --json's stdout stays one object.
    code = 'import os\nwith open(f"/proc/{os.getppid()}/fd/1", "a") as stdout:\n    stdout.write("forged\\n")'
    result = kvports_check(hostile(tmp_path, FULL, code), "--quick")
    assert result.returncode == 0 and json.loads(result.stdout)["ok"], result.stdout[:200]
    assert "forged" in result.stderr  # it went to stderr, with the implementation's other output


def pid_in(path) -> int:
    return int(path.read_text())


@contextlib.contextmanager
def killed_after(pid_file):
    """Whatever the check leaves running, the test does not."""
    try:
        yield
    finally:
        if pid_file.exists() and running([pid_in(pid_file)]):
            os.kill(pid_in(pid_file), signal.SIGKILL)


def test_a_daemon_the_implementation_starts_ends_with_the_check(capsys, tmp_path):
    # A double fork and setsid(): the daemon is in neither the child's process group nor its session,
    # and its parent exits; it holds none of the checker's pipes.
    pid_file = tmp_path / "daemon.pid"
    code = f"""import os
first = os.fork()
if first == 0:
    os.setsid()
    daemon = os.fork()
    if daemon == 0:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, 65536)
        os.execvp("sleep", ["sleep", "600"])
    with open({str(pid_file)!r}, "w") as out:
        out.write(str(daemon))
    os._exit(0)
os.waitpid(first, 0)"""
    with killed_after(pid_file):
        exit_status, report = command_json(capsys, hostile(tmp_path, LOAD, code), "--quick")
        assert (exit_status, report["ok"]) == (0, True)
        assert running([pid_in(pid_file)], wait=5) == []


def test_a_process_holding_the_childs_pipes_does_not_stretch_the_timeout(tmp_path):
    # It forks a process that sleeps holding every pipe the child has; the child itself answers every call.
    pid_file = tmp_path / "holder.pid"
    code = f"""import os, time
holder = os.fork()
if holder == 0:
    time.sleep(600)
    os._exit(0)
with open({str(pid_file)!r}, "w") as out:
    out.write(str(holder))"""
    with killed_after(pid_file):
        result = kvports_check(hostile(tmp_path, LOAD, code), "--quick", "--timeout", "5")
        assert result.returncode == 0 and json.loads(result.stdout)["ok"], result.stderr[-2000:]
        assert running([pid_in(pid_file)], wait=5) == []


def test_an_exception_message_is_shown_with_its_control_characters_escaped(capsys, tmp_path):
    path = tmp_path / "impl.py"
    path.write_text('raise ValueError("\\x1b[2J\\x1b[31mred\\x07")\n' + ADAPTER.read_text())
    err = assert_one_error_line(*run_cli(capsys, "check", path))
    assert "\x1b" not in err and "\x07" not in err
    assert "ValueError: \\x1b[2J\\x1b[31mred\\x07" in err, err


def test_an_exception_message_is_shown_as_text_not_as_markup(capsys, tmp_path):
    code = 'if state is not None:\n    raise ValueError("[/bogus] [bold]not bold")'
    exit_status, out, err = run_cli(capsys, "check", hostile(tmp_path, STEP, code), "--quick")
    assert (exit_status, "Traceback" in err) == (1, False), err[-2000:]
    assert "step raised ValueError" in out and "[/bogus] [bold]not bold" in out
