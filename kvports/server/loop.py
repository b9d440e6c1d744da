"""The engine's loop: one thread owns the engine and steps it; HTTP requests reach it through a queue.

A request (a `Job`: one engine request per choice) is handed over with `submit`, joins the running
batch at the next step that has room, and gets its tokens back after every step, through its own
asyncio queue on the server's event loop (`call_soon_threadsafe`: the engine thread never touches
the event loop's objects). `cancel` (the client went away) ends its sequences before the next step,
their blocks back at once. Nothing else touches the engine, so the engine needs no lock.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from kvports.batching.request import Request
from kvports.batching.scheduler import Sequence, Status
from kvports.server.metrics import Metrics
from kvports.shared.errors import UserError

IDLE_WAIT_S = 0.05  # an idle engine's wait for a request, between looks at whether to stop


class QueueFull(Exception):
    """More requests than the batch and the queue hold: the server answers 429."""


@dataclass(eq=False)  # each choice is itself: two with the same request are two
class Choice:
    index: int
    request: Request
    sequence: Sequence | None = None  # set by the engine thread once queued
    sent: int = 0  # generated tokens already handed out
    last_token_time: float | None = None
    done: bool = False


@dataclass(eq=False)
class Job:
    """One HTTP request: its choices and the queue their events arrive on, in the server's event loop.
    Events: ("tokens", index, (ids, logprobs)), ("finish", index, reason), ("error", index, message);
    logprobs: each id's TokenLogprobs if the request asked for them, else empty."""

    choices: list[Choice]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: bool = False

    def emit(self, *event: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed: the server is gone, nobody listens
            pass


class EngineLoop:
    def __init__(self, engine: Any, metrics: Metrics, max_queue: int):
        self.engine = engine
        self.metrics = metrics
        self.capacity = engine.settings.max_batch + max_queue  # choices running or waiting, at most
        self.inbox: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.in_flight = 0  # choices submitted and not yet ended
        self.handed = 0  # choices submitted, not yet taken from the inbox
        self.active: list[tuple[Job, Choice]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="kvports-engine", daemon=True)

    # ---------------------------------------------------------------- any thread

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.stopping.is_set():
                raise QueueFull("the server is shutting down")
            if self.in_flight + len(job.choices) > self.capacity:
                raise QueueFull(
                    f"{self.in_flight} requests are running or waiting, the most this server holds is {self.capacity}"
                )
            self.in_flight += len(job.choices)
            self.handed += len(job.choices)
        self.inbox.put(("add", job))

    def cancel(self, job: Job) -> None:
        """End every choice of a request (its client went away)."""
        if not job.cancelled:
            job.cancelled = True
            self.inbox.put(("cancel", (job, None, "cancelled")))

    def stop_choice(self, job: Job, index: int) -> None:
        """End one choice now (a stop string ended its text): reason "stop"."""
        self.inbox.put(("cancel", (job, index, "stop")))

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what still runs and end the thread."""
        self.stopping.set()
        self.inbox.put(("stop", None))
        self.thread.join(timeout)

    # ---------------------------------------------------------------- the engine thread

    def run(self) -> None:
        engine = self.engine
        while not self.stopping.is_set():
            self.take_inbox(block=engine.idle)
            if engine.idle:
                continue
            try:
                engine.step()
            except Exception as exc:  # the engine ended every request and freed every block: tell their clients
                traceback.print_exc(file=sys.stderr)
                self.publish(f"the engine's step failed ({type(exc).__name__}: {exc})")
            else:
                self.publish(None)
        for job, choice in list(self.active):
            self.end(job, choice, "cancelled")
        while True:  # requests handed over as it stopped: ended, not left waiting
            try:
                kind, what = self.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                for choice in what.choices:
                    self.release(choice)
                    what.emit("finish", choice.index, "cancelled")

    def take_inbox(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, what = item
            if kind == "add":
                self.add(what)
            elif kind == "cancel":
                job, index, reason = what
                for choice in job.choices:
                    if not choice.done and index in (None, choice.index):
                        self.end(job, choice, reason)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def add(self, job: Job) -> None:
        with self.lock:
            self.handed -= len(job.choices)
        for choice in job.choices:
            if job.cancelled or self.stopping.is_set():
                self.release(choice)
                continue
            try:
                choice.sequence = self.engine.add(choice.request)
                choice.sequence.arrival = job.arrival  # time to first token from the request's arrival
            except UserError as exc:  # checked before, so not expected: the request ends, not the server
                self.release(choice)
                job.emit("error", choice.index, str(exc))
                continue
            self.active.append((job, choice))
            self.metrics.prompt_tokens.inc(len(choice.request.prompt))

    def publish(self, failure: str | None) -> None:
        """Each active choice's new tokens, and the end of those that finished."""
        now = time.perf_counter()
        for job, choice in list(self.active):
            sequence = choice.sequence
            assert sequence is not None
            new = sequence.generated[choice.sent :]
            logprobs = sequence.logprobs[choice.sent : choice.sent + len(new)]  # [] unless it asked
            if new:
                if choice.sent == 0:
                    self.metrics.ttft.observe(now - job.arrival)
                elif choice.last_token_time is not None:
                    self.metrics.itl.observe((now - choice.last_token_time) / len(new))
                choice.sent += len(new)
                choice.last_token_time = now
                self.metrics.generation_tokens.inc(len(new))
                job.emit("tokens", choice.index, (list(new), logprobs))
            if sequence.status is Status.FINISHED:
                reason = sequence.finish_reason or "error"
                if reason == "error":
                    message = failure or (
                        f"the model's logits overflowed {self.engine.dtype} (an inf or a NaN) at generated token "
                        f"{len(sequence.generated)}: the request ended"
                    )
                    job.emit("error", choice.index, message)
                self.end(job, choice, reason)
        self.metrics.engine(self.engine, self.handed)

    def end(self, job: Job, choice: Choice, reason: str) -> None:
        """A choice is over: its sequence out of the engine (blocks back), the client told."""
        sequence = choice.sequence
        if sequence is not None and sequence.status is not Status.FINISHED:
            self.engine.cancel(sequence, reason)
        if (job, choice) in self.active:
            self.active.remove((job, choice))
        if reason != "error":
            job.emit("finish", choice.index, reason)
        self.metrics.finished.labels(reason).inc()
        self.release(choice)
        self.metrics.engine(self.engine, self.handed)

    def release(self, choice: Choice) -> None:
        if not choice.done:
            choice.done = True
            with self.lock:
                self.in_flight -= 1
