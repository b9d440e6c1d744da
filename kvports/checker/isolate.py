"""The checks in a child process, so that nothing the implementation does can end, hang or
corrupt the checker: `python -m kvports.checker.child FD TARGET FAMILY QUICK` runs
suite.run_check and sends what happens over the pipe FD, one JSON object a line:

  {"event": "begin", "report": {...}}    the checks start (the report's header)
  {"event": "call", "function": NAME}    the implementation's code runs (plugin.call, an import)
  {"event": "return"}                    ... and returned (or raised)
  {"event": "check", "check": {...}}     a row, as soon as it is decided
  {"event": "explain", "diagnosis": D, "line": L}   a diagnosis (or None) and its line, as found
  {"event": "report", "report": {...}}   the whole report: the checks ended
  {"event": "user_error", "message": M}  the implementation cannot be checked (exit status 2)

The parent times each call (--timeout) and stops the child at the limit; where the child ends
without a report (sys.exit from a thread, os._exit, a signal, the kernel's out-of-memory killer),
the rows it sent and one naming the call that was running make the report. The child's stdout
and stderr both come back to the parent's stderr: stdout is the report's alone.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from typing import Any

from kvports.checker.report import FAIL, TIMEOUT, Check, Report
from kvports.shared.errors import UserError, echo_path

DEFAULT_TIMEOUT = 120.0  # seconds one call of the implementation may take (a Flax model's first call compiles)
SILENCE, MIN_SILENCE = 10, 600.0  # between calls, the child may be silent max(10 timeouts, 10 minutes)
DRAIN = 2.0  # seconds to wait for the last output once the child has sent its last event


def ended(returncode: int) -> str:
    """How a process ended, in words."""
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return f"killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    return f"exit status {returncode}"


class Watch:
    """What the parent knows of the child: the rows so far, the call running now."""

    def __init__(self) -> None:
        self.header: dict[str, Any] | None = None
        self.checks: list[dict[str, Any]] = []
        self.diagnoses: list[str] = []
        self.explanations: list[str] = []
        self.calls: list[tuple[str, float]] = []  # (function, when it started): nested calls, innermost last
        self.final: dict[str, Any] | None = None
        self.user_error: str | None = None
        self.heard = time.monotonic()  # when the child last said anything

    def hear(self, event: dict[str, Any]) -> None:
        self.heard = time.monotonic()
        kind = event["event"]
        if kind == "begin":
            self.header = event["report"]
        elif kind == "call":
            self.calls.append((event["function"], time.monotonic()))
        elif kind == "return" and self.calls:
            self.calls.pop()
        elif kind == "check":
            self.checks.append(event["check"])
        elif kind == "explain":
            self.diagnoses += [event["diagnosis"]] if event["diagnosis"] is not None else []
            self.explanations.append(event["line"])
        elif kind == "report":
            self.final = event["report"]
        elif kind == "user_error":
            self.user_error = event["message"]

    def deadline(self, timeout: float) -> float | None:
        """Seconds left to the running call (the outermost one bounds them all); None outside any call."""
        return None if not self.calls else max(0.0, self.calls[0][1] + timeout - time.monotonic())


def run_isolated(target: str, family: str = "seed", quick: bool = False, timeout: float = DEFAULT_TIMEOUT) -> Report:
    """suite.run_check in a child process: the report, however the implementation behaves.
    UserError where it cannot be checked at all (as run_check), or ends or hangs on import."""
    events_read, events_write = os.pipe()
    command = [sys.executable, "-m", "kvports.checker.child", str(events_write), target, family, str(int(quick))]
    child = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        pass_fds=(events_write,),
    )
    os.close(events_write)
    assert child.stdout is not None
    watch, timed_out = Watch(), None
    selector = selectors.DefaultSelector()
    selector.register(events_read, selectors.EVENT_READ, "events")
    selector.register(child.stdout.fileno(), selectors.EVENT_READ, "output")
    pending, events_open, drain_until = b"", True, 0.0
    try:
        while selector.get_map():
            now = time.monotonic()
            left = watch.deadline(timeout)
            if not events_open:  # the child is done: its last output, briefly (a grandchild may hold the pipe)
                drain_until = drain_until or now + DRAIN
                left = max(0.0, drain_until - now)
            elif left is None:  # between calls: the checker's own work, bounded generously
                left = max(0.0, watch.heard + max(SILENCE * timeout, MIN_SILENCE) - now)
            ready = selector.select(left)
            if not ready:
                if events_open:
                    timed_out = watch.calls[0][0] if watch.calls else "the checks between calls"
                break
            for key, _ in ready:
                data = os.read(key.fd, 1 << 16)
                if not data:
                    selector.unregister(key.fd)
                    events_open = events_open and key.data != "events"
                elif key.data == "output":  # the implementation's prints, and the child's own: stderr
                    sys.stderr.write(data.decode(errors="replace"))
                    sys.stderr.flush()
                else:
                    pending += data
                    *lines, pending_line = pending.split(b"\n")
                    pending = pending_line
                    for line in lines:
                        watch.hear(json.loads(line))
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        selector.close()
        os.close(events_read)
        child.stdout.close()
    return outcome(watch, target, timeout, timed_out, child.returncode)


def outcome(watch: Watch, target: str, timeout: float, timed_out: str | None, returncode: int) -> Report:
    """The child's report; or, where it did not send one, the rows it sent and a verdict on the call that
    hung or ended it."""
    if watch.user_error is not None:
        raise UserError(watch.user_error)
    if watch.final is not None and timed_out is None:
        return Report.from_dict(watch.final)
    function = timed_out or (watch.calls[-1][0] if watch.calls else None)
    how = f"did not return within {timeout:g} s" if timed_out else f"ended the process ({ended(returncode)})"
    if watch.header is None:  # nothing checked yet: the import (or the checker's own start) never finished
        if function is not None:
            limit = f" (--timeout {timeout:g})" if timed_out else ""
            raise UserError(f"cannot check {echo_path(target)}: {function} {how}{limit}")
        raise UserError(f"cannot check {echo_path(target)}: the checker's process ended ({ended(returncode)})")
    found = {"checks": watch.checks, "diagnoses": watch.diagnoses, "explanations": watch.explanations}
    report = Report.from_dict({**watch.header, **found})
    if function is None:
        report.checks.append(Check("the checks' process", FAIL, f"ended between calls ({ended(returncode)})"))
        report.explanations.append(
            f"the process ended ({ended(returncode)}) outside any call of the implementation "
            "(a thread it started, or memory): the checks after it did not run"
        )
        return report
    status = TIMEOUT if timed_out else FAIL
    report.checks.append(Check(f"{function} returns", status, how, function))
    hint = (
        "a loop that never ends, or a wait on something that never comes (input, a lock, a network)"
        if timed_out
        else "a function under check must return its result, not end the process (os._exit, a crash in native code)"
    )
    report.explanations.append(f"{function} {how}: {hint}; the checks after it did not run")
    return report
