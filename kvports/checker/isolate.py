"""The implementation in a child process, so that nothing it does can end, hang or corrupt the
checker, or decide its verdict. The checks (suite.py) run here, in the checker's own process;
the child (child.py) only runs the implementation's calls, one request at a time, and sends
back the values each returned (logits, tokens, an exception's type and message) over a pipe of
its own (wire.py). The comparisons, the rows and the exit status are all computed here, from
values held to their expected types and shapes: whatever the child writes on that pipe can at
most be wrong values (a FAIL row), or not a reply at all, which fails the call it answered.

- Each call has --timeout seconds of wall-clock time, counted here (select on the pipes with
  the deadline, never a wait for EOF): a call that does not answer in time is a TIMEOUT row,
  whatever holds the pipes open.
- The child's stdout and stderr are a pipe this process reads and copies to its own stderr
  (at most MAX_OUTPUT bytes); and while the child runs, this process's own file descriptor 1
  is its stderr too (suite.stdout_to_stderr), so that even /proc/<its parent>/fd/1 is not the
  report's stdout. The report is written to stdout only after every process of the check ended.
- The child runs in a session and process group of its own, and every process it started is
  killed when the check ends, daemons included (contain.py).

Where the child ends, hangs or sends what is not a reply, the rows decided before stand and one
more names the call and what happened to it; the checks after it do not run.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import math
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvports.checker import wire
from kvports.checker.contain import Contained, contained
from kvports.checker.implementation import Implementation
from kvports.checker.plugin import Calls, ImplementationError, printable
from kvports.checker.report import FAIL, TIMEOUT, Check, Report
from kvports.checker.suite import checked, checker_for, refuse_family, stdout_to_stderr
from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError, echo_path

DEFAULT_TIMEOUT = 120.0  # seconds one call of the implementation may take (a Flax model's first call compiles)
STARTUP = 600.0  # seconds the child may take to start (Python, NumPy, kvports), before any of the implementation runs
DRAIN = 2.0  # seconds to wait for the child's exit status once it closed its end of the channel
TICK = 0.05  # seconds between two looks at whether the child still runs (a grandchild may hold the pipes)
MAX_OUTPUT = 1 << 20  # bytes of the implementation's own output (prints, native writes) copied to stderr
MAX_CALLS = 100_000  # forward calls a prefill may report
MAX_USER_ERROR = 2000  # characters of the child's refusal shown (it names parameters, shapes, a path)
FUNCTIONS = ("TinyModel.forward", "full", "step")  # what a driver may call its forwards (plugin.py)


# The child imports the kvports this process runs (`python -m` would look in the working directory first,
# where another checkout's kvports may be).
CHILD = (
    f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r}); "
    "from kvports.checker.child import child_main; sys.exit(child_main(sys.argv[1:]))"
)


def ended(returncode: int) -> str:
    """How a process ended, in words."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    return f"exit status {returncode}"


class Stopped(Exception):
    """The child did not answer a call: it ended, hung or sent what is not a reply. function None:
    it ended between two calls."""

    def __init__(self, function: str | None, how: str, status: str = FAIL, hint: str = ""):
        self.function, self.how, self.status, self.hint = function, how, status, hint
        super().__init__(f"{function} {how}")


class Worker:
    """The child process and the checker's end of its pipes."""

    def __init__(self, timeout: float, processes: Contained):
        self.timeout, self.processes = timeout, processes
        requests_read, self.requests = os.pipe()
        self.replies, replies_write = os.pipe()
        self.output, output_write = os.pipe()
        command = [sys.executable, "-c", CHILD, str(requests_read), str(replies_write)]
        try:
            self.child = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=output_write,
                stderr=output_write,
                pass_fds=(requests_read, replies_write),
                start_new_session=True,  # its own session and process group: contain.py ends them
            )
        finally:
            for fd in (requests_read, replies_write, output_write):
                os.close(fd)
        processes.started(self.child)
        for fd in (self.requests, self.replies, self.output):
            os.set_blocking(fd, False)
        self.buffer, self.scanned = bytearray(), 0  # what the child sent, not yet a whole line; how far read for one
        self.replies_open, self.output_open = True, True
        self.copied, self.dropped = 0, 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    # -- the implementation's output: copied to stderr, bounded ---------------------------
    def copy_output(self) -> None:
        try:
            data = os.read(self.output, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            self.output_open = False
            return
        room = max(0, MAX_OUTPUT - self.copied)
        self.copied += min(room, len(data))
        self.dropped += len(data) - min(room, len(data))
        if room:
            sys.stderr.write(self.decoder.decode(data[:room]))
            sys.stderr.flush()

    def read_replies(self) -> None:
        try:
            data = os.read(self.replies, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            self.replies_open = False
        self.buffer += data

    def line(self) -> bytes | None:
        """The next whole line the child sent, if there is one; Malformed past MAX_LINE."""
        end = self.buffer.find(b"\n", self.scanned)
        if max(end, len(self.buffer) if end < 0 else 0) > wire.MAX_LINE:
            raise wire.Malformed(f"a reply longer than {wire.MAX_LINE} bytes")
        if end < 0:
            self.scanned = len(self.buffer)  # the next look starts where this one ended
            return None
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 1]
        self.scanned = 0
        return line

    def drain(self) -> None:
        """What the child wrote before it ended (its last reply, its last output), without waiting."""
        for _ in range(wire.MAX_LINE >> 16):
            before = len(self.buffer)
            if self.replies_open:
                self.read_replies()
            if len(self.buffer) == before:
                break
        for _ in range(MAX_OUTPUT >> 14):
            if not self.output_open:
                break
            copied = self.copied + self.dropped
            self.copy_output()
            if self.copied + self.dropped == copied:
                break

    # -- one call ---------------------------------------------------------------------------
    def ask(self, function: str, request: dict[str, Any]) -> Any:
        """The value the child's reply holds; ImplementationError or UserError where the call raised;
        Stopped where the child ended, did not answer within --timeout or sent what is not a reply."""
        if self.child.poll() is not None:
            raise Stopped(None, ended(self.child.returncode))
        return self.answer(function, wire.encode(request), self.timeout)

    def started(self) -> None:
        """The child's first line, once it has started (before any of the implementation runs)."""
        try:
            ready = self.answer("the checker's process", b"", STARTUP, "did not start")
        except Stopped as stop:  # it is the process: it "ended", not "ended the process"
            raise Stopped(stop.function, stop.how.replace("ended the process", "ended"), stop.status) from None
        if ready != "ready":
            raise Stopped("the checker's process", "did not start")

    def answer(self, function: str, request: bytes, seconds: float, late: str = "did not return") -> Any:
        pending, deadline = memoryview(request), time.monotonic() + seconds
        with as_stopped(function):
            while (line := self.line()) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Stopped(function, f"{late} within {seconds:g} s", TIMEOUT)
                readers = [fd for fd, on in ((self.replies, self.replies_open), (self.output, self.output_open)) if on]
                ready, writable, _ = select.select(readers, [self.requests] if pending else [], [], min(left, TICK))
                if writable:
                    try:
                        pending = pending[os.write(self.requests, pending[: 1 << 16]) :]
                    except BrokenPipeError:  # the child closed its end: it ended, or will
                        pending = memoryview(b"")
                if self.output in ready:
                    self.copy_output()
                if self.replies in ready:
                    self.read_replies()
                if not self.line_ready() and (not self.replies_open or self.child.poll() is not None):
                    self.drain()  # its last reply may still be in the pipe
                    if not self.line_ready():
                        raise Stopped(function, self.gone())
            return self.reply(line)

    def line_ready(self) -> bool:
        return self.buffer.find(b"\n", self.scanned) >= 0 or len(self.buffer) > wire.MAX_LINE

    def gone(self) -> str:
        """How the child ended; it may have closed its end of the channel and still run."""
        try:
            return f"ended the process ({ended(self.child.wait(DRAIN))})"
        except subprocess.TimeoutExpired:
            return "closed its end of the channel"

    @staticmethod
    def reply(line: bytes) -> Any:
        message = wire.decode(line)
        if not isinstance(message, dict) or len(message) != 1:
            raise wire.Malformed("not one of {value}, {error}, {user_error}")
        ((kind, value),) = message.items()
        if kind == "value":
            return value
        if kind == "error":
            raise ImplementationError.received(value)
        if kind == "user_error" and isinstance(value, str):
            raise UserError(printable(value, MAX_USER_ERROR))
        raise wire.Malformed("not one of {value}, {error}, {user_error}")

    def close(self) -> None:
        """End every process of the check, then copy what output is left."""
        self.processes.end()
        self.child.wait()
        self.drain()
        if self.dropped:
            sys.stderr.write(f"\n[the implementation wrote {self.dropped} more bytes, not shown]\n")
        for fd in (self.requests, self.replies, self.output):
            os.close(fd)


MALFORMED = (
    "the child process answers each call with the values it returned, one JSON line; anything else on its "
    "channel (a claimed result, a line that is not JSON, the wrong types) is no answer"
)


class Remote:
    """A driver (plugin.Driver's methods) whose calls run in the child: values in, values out, each
    reply held to its type before the checks see it."""

    def __init__(self, worker: Worker, target: str):
        self.worker = worker
        name = Path(target).name if target.endswith(".py") or "/" in target or Path(target).exists() else target
        function = f"import {name}"
        info = worker.ask(function, {"op": "load", "target": target})
        with as_stopped(function):
            self.kind = choice(info, "kind", ("post", "adapter"))
            self.framework = choice(info, "framework", ("torch", "other"))
            self.full_name, self.step_name = choice(info, "full_name", FUNCTIONS), choice(info, "step_name", FUNCTIONS)

    def build(self, config: ModelConfig, weights: dict[str, np.ndarray], dtype: str) -> Any:
        function = "TinyModel()" if self.kind == "post" else "load"
        packed = {name: given(array) for name, array in weights.items()}
        fields = {"config": dataclasses.asdict(config), "weights": packed, "dtype": dtype}
        model = self.worker.ask(function, request("build", **fields))
        with as_stopped(function):
            if not wire.natural(model):
                raise wire.Malformed("not a model number")
            return model

    def full(self, model: Any, tokens: np.ndarray) -> tuple[np.ndarray, str]:
        function = self.full_name
        reply = self.worker.ask(function, request("full", model=model, tokens=given(tokens)))
        with as_stopped(function):
            return wire.unpack(wire.member(reply, "logits", "the reply"), "its logits")

    def step(self, model: Any, tokens: np.ndarray, state: Any) -> tuple[np.ndarray, str, Any]:
        function = self.step_name
        reply = self.worker.ask(function, request("step", model=model, tokens=given(tokens), state=state))
        with as_stopped(function):
            logits, low = wire.unpack(wire.member(reply, "logits", "the reply"), "its logits")
            return logits, low, wire.field(reply, "state", int, "the reply")

    def generate(self, model: Any, prompt: np.ndarray, n: int, mode: str) -> np.ndarray:
        function = f"generate_{mode}"
        reply = self.worker.ask(function, request("generate", model=model, prompt=given(prompt), n=n, mode=mode))
        with as_stopped(function):
            return wire.unpack(wire.member(reply, "tokens", "the reply"), "its tokens")[0]

    def prefill(self, model: Any, prompt: np.ndarray) -> tuple[str, Calls | None]:
        function = "generate_cached" if self.kind == "post" else "step"
        reply = self.worker.ask(function, request("prefill", model=model, prompt=given(prompt)))
        with as_stopped(function):
            wire.field(reply, "function", str, "the reply")
            calls = wire.field(reply, "calls", (list, type(None)), "the reply")
            if calls is None:
                return function, None
            if len(calls) > MAX_CALLS or not all(is_call(call) for call in calls):
                raise wire.Malformed("forward calls that are not [shape, seconds]")
            return function, [(tuple(shape), float(seconds)) for shape, seconds in calls]

    def can_step(self, model: Any) -> bool:
        return self.yes_or_no(f"{self.full_name}'s parameters", "can_step", model)

    def training(self, model: Any) -> bool:
        return self.yes_or_no("model.training", "training", model)

    def to_eval(self, model: Any) -> None:
        self.worker.ask("model.eval()", request("to_eval", model=model))

    def yes_or_no(self, function: str, op: str, model: Any) -> bool:
        value = self.worker.ask(function, request(op, model=model))
        with as_stopped(function):
            if not isinstance(value, bool):
                raise wire.Malformed("not true or false")
            return value


def request(op: str, **fields: Any) -> dict[str, Any]:
    return {"op": op, **fields}


def given(array: np.ndarray) -> dict[str, Any]:
    """An input of a call (weights, tokens), whatever its size: the parent's own."""
    return wire.pack(array, limit=None)


@contextlib.contextmanager
def as_stopped(function: str) -> Iterator[None]:
    """What is not a reply fails the call it answered (and ends the checks: the child is not trusted after)."""
    try:
        yield
    except wire.Malformed as error:
        raise Stopped(function, f"sent what is not a reply ({error})", FAIL, MALFORMED) from None


def choice(info: Any, name: str, allowed: tuple[str, ...]) -> str:
    value = wire.field(info, name, str, "the reply")
    if value not in allowed:
        raise wire.Malformed(f"its {name} is none of {', '.join(allowed)}")
    return value


def is_call(call: Any) -> bool:
    if not (isinstance(call, list) and len(call) == 2 and isinstance(call[0], list) and len(call[0]) <= wire.MAX_DIMS):
        return False
    shape, seconds = call
    return (
        all(wire.natural(n) for n in shape)
        and isinstance(seconds, (int, float))
        and not isinstance(seconds, bool)
        and math.isfinite(seconds)
    )


def run_isolated(target: str, family: str = "seed", quick: bool = False, timeout: float = DEFAULT_TIMEOUT) -> Report:
    """The checks on an implementation (a file path or a module name) whose calls run in a child
    process: the report, however the implementation behaves. UserError where it cannot be checked
    at all (as run_check), or ends or hangs on import."""
    refuse_family(family)
    with stdout_to_stderr(), contained() as processes:
        worker = Worker(timeout, processes)
        try:
            return check(worker, target, family, quick)
        finally:
            worker.close()


def check(worker: Worker, target: str, family: str, quick: bool) -> Report:
    try:
        worker.started()
        driver = Remote(worker, target)
    except Stopped as stop:  # nothing checked yet: the import (or the checker's own start) never finished
        function = stop.function or "the checker's process"
        limit = f" (--timeout {worker.timeout:g})" if stop.status == TIMEOUT and function.startswith("import") else ""
        raise UserError(f"cannot check {echo_path(target)}: {function} {stop.how}{limit}") from None
    checker = checker_for(Implementation(driver), family, target, quick)
    try:
        return checked(checker)
    except Stopped as stop:
        return stopped(checker.report, stop)


def stopped(report: Report, stop: Stopped) -> Report:
    """The rows decided before the child stopped answering, and one naming the call it did not answer, and how."""
    if stop.function is None:
        report.checks.append(Check("the checks' process", FAIL, f"ended between calls ({stop.how})"))
        report.explanations.append(
            f"the process ended ({stop.how}) outside any call of the implementation "
            "(a thread it started, or memory): the checks after it did not run"
        )
        return report
    report.checks.append(Check(f"{stop.function} returns", stop.status, stop.how, stop.function))
    hint = stop.hint or (
        "a loop that never ends, or a wait on something that never comes (input, a lock, a network)"
        if stop.status == TIMEOUT
        else "a function under check must return its result, not end the process (os._exit, a crash in native code)"
    )
    report.explanations.append(f"{stop.function} {stop.how}: {hint}; the checks after it did not run")
    return report
