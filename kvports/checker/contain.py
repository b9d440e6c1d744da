"""Every process an implementation under check starts ends with the check.

The child process runs in a session (and process group) of its own, so a terminal's signals go
to the checker alone and one killpg reaches what the child forks. A process that calls setsid()
leaves that group, and one whose parent exits (a daemon's double fork) would be adopted by init
and outlive everything; so while a check runs, the checker is a child subreaper
(prctl(PR_SET_CHILD_SUBREAPER), Linux 3.4): an orphan among its descendants is adopted by the
checker instead, where it can be found. At the end, every process descended from the child, or
adopted by the checker in a session other than the checker's own (the child's tree is never in
it: setsid() only ever makes a new session), is killed (SIGKILL) and reaped, until none is left.
Elsewhere than Linux, the child's process group alone is killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37
PASSES, PAUSE = 500, 0.01  # kill and reap at most this many times, this far apart: 5 s for a tree that keeps forking
_one_at_a_time = threading.Lock()  # the subreaper is the whole process's: one check in a process at a time


def prctl(option: int, value: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(option, value, 0, 0, 0) == 0


def subreaper() -> bool:
    """Whether this process already adopts its descendants' orphans."""
    flag = ctypes.c_int(0)
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0 and flag.value != 0


def processes() -> dict[int, tuple[int, int]]:
    """Every process this one can see: pid -> (parent pid, session id), from /proc/PID/stat."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                text = stat.read(4096)
        except OSError:  # it ended meanwhile
            continue
        fields = text[text.rfind(b")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp session ...
        if len(fields) > 3:
            table[int(entry)] = (int(fields[1]), int(fields[3]))
    return table


class Contained:
    """The processes of one check: its child, and whatever the child started."""

    def __init__(self) -> None:
        self.linux = sys.platform.startswith("linux") and os.path.isdir("/proc")
        self.me, self.session = os.getpid(), os.getsid(0)
        self.before = {pid for pid, (ppid, _) in processes().items() if ppid == self.me} if self.linux else set()
        self.child: subprocess.Popen | None = None

    def started(self, child: subprocess.Popen) -> None:
        self.child = child

    def theirs(self, table: dict[int, tuple[int, int]]) -> set[int]:
        """The child's descendants, and the orphans among them this process adopted; the child itself
        too, until its Popen has reaped it (its number may be another process's after that)."""
        child = self.child
        roots = {child.pid} if child is not None and child.returncode is None and child.pid in table else set()
        roots |= {
            pid
            for pid, (ppid, session) in table.items()
            if ppid == self.me and pid not in self.before and session != self.session
        }
        found, frontier = set(roots), set(roots)
        while frontier:
            frontier = {pid for pid, (ppid, _) in table.items() if ppid in frontier and pid not in found}
            found |= frontier
        return found

    def end(self) -> None:
        """Kill the child's process group, then every process of theirs, reaping those this process
        adopted, until none is left (or PASSES rounds of a tree that keeps forking)."""
        child = self.child
        if child is None:
            return
        if child.poll() is None:  # not reaped: its number is still its process group's
            with contextlib.suppress(OSError):
                os.killpg(child.pid, signal.SIGKILL)
            child.kill()
        if not self.linux:
            return
        for _ in range(PASSES):
            table = processes()
            left = self.theirs(table) - {child.pid}  # the child itself: its Popen reaps it
            if not left:
                return
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            for pid in left:
                if table[pid][0] == self.me:  # adopted: this process must reap it
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(pid, os.WNOHANG)
            time.sleep(PAUSE)


@contextlib.contextmanager
def contained() -> Iterator[Contained]:
    """While inside, this process adopts the orphans of the processes it starts; at the end, every
    process of the one check started inside (Contained.started) is killed."""
    with _one_at_a_time:
        processes_of = Contained()
        adopting = processes_of.linux and not subreaper() and prctl(PR_SET_CHILD_SUBREAPER, 1)
        try:
            yield processes_of
        finally:
            try:
                processes_of.end()
            finally:
                if adopting:
                    prctl(PR_SET_CHILD_SUBREAPER, 0)
