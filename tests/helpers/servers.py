"""`kvports serve` servers for the tests: in this process (a thread each: uvicorn and the engine's loop)
on a free loopback port, or as a subprocess; ports whose steps are slowed or fail on purpose; and
the reads of `/metrics` the tests make. Every wait is bounded."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvports.cli import build_parser
from kvports.commands import serve
from kvports.flags import resolve_model
from kvports.shared.generation import PAD, GenerationConfig, row_tokens

START_S = 60  # a server's start, JAX's warm-up compile included
WAIT_S = 20  # anything a test waits for once the server runs


@dataclass
class Running:
    url: str
    state: Any  # kvports.server.app.ServerState
    server: Any  # the uvicorn server
    thread: threading.Thread

    @property
    def engine(self) -> Any:
        return self.state.loop.engine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT_S)
        self.state.loop.stop()


def start_server(*argv: object, wrap_port: Any = None) -> Running:
    """`kvports serve ARGV` in this process, on a free loopback port."""
    args = build_parser(only="serve").parse_args(["serve", *map(str, argv), "--port", "0"])
    resolve_model(args)
    state, app = serve.prepare(args, wrap_port)
    state.loop.start()
    server = serve.make_server(app, state, "127.0.0.1", 0, args)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            state.loop.stop()
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    return Running(server.url, state, server, thread)


def start_process(*argv: object, step_s: float | None = None) -> tuple[subprocess.Popen, str]:
    """`kvports serve ARGV` as a subprocess on a free loopback port, and its URL once it says it is ready.
    step_s: every engine step takes at least that long (tests.helpers.slow_serve)."""
    program = ["kvports.cli"] if step_s is None else ["tests.helpers.slow_serve", str(step_s)]
    command = [sys.executable, "-m", *program, "serve", *map(str, argv), "--port", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    timer = threading.Timer(START_S, process.kill)  # a server that never says it is ready ends the read
    timer.start()
    try:
        line = process.stdout.readline()
    finally:
        timer.cancel()
    if "ready on " not in line:
        process.kill()
        raise RuntimeError(f"the server did not start: {line!r} {process.communicate(timeout=WAIT_S)[1][-2000:]}")
    return process, line.split("ready on ", 1)[1].split()[0]


def alone(server: Running, prompt: list[int], **settings) -> list[int]:
    """The new tokens port.generate gives the prompt alone (what `kvports generate` runs), stopping
    at the model's eos ids as the server does."""
    engine = server.engine
    stops = tuple(engine.config.eos_token_ids)
    generation = GenerationConfig(stop_ids=stops, **settings)
    tokens, _ = engine.port.generate(engine.model, np.asarray([prompt]), generation, "cached")  # [1, P + N]
    return row_tokens(tokens)[0][len(prompt) :]


def metric(text: str, name: str, default: float | None = None) -> float:
    """A sample's value in Prometheus' text format (the first line starting with `name`); `default`
    for one not shown yet (a label no request has had)."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    if default is None:
        raise KeyError(name)
    return default


def wait_for(condition: Any, seconds: float = WAIT_S) -> bool:
    """Whether `condition()` came true within `seconds`, polled every 20 ms."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class SlowPort:
    """A port whose every step takes at least `seconds`: requests stay running long enough for a
    test to act while they do."""

    def __init__(self, port: Any, seconds: float):
        self.port, self.seconds = port, seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(self.port, name)

    def paged_step(self, *args: Any) -> Any:
        time.sleep(self.seconds)
        return self.port.paged_step(*args)


class OverflowingPort:
    """A port that gives PAD (what a port gives a row whose logits held an inf or a NaN) to every row
    whose step tokens hold `marker`: the server's handling of an overflow, whatever the model."""

    def __init__(self, port: Any, marker: int):
        self.port, self.marker = port, marker

    def __getattr__(self, name: str) -> Any:
        return getattr(self.port, name)

    def paged_step(self, model: Any, pool: Any, tokens: np.ndarray, *rest: Any) -> Any:
        next_tokens, pool, steps = self.port.paged_step(model, pool, tokens, *rest)
        next_tokens = np.where((tokens == self.marker).any(axis=1), PAD, next_tokens)  # [B]
        return next_tokens, pool, steps


def start_exact_server(framework: str, weights: object) -> Running:
    """A float64 server of up to 4 rows: what the log-probability tests (echo, lm-eval) hold to 1e-9. JAX
    compiles each program when first asked (--no-precompile: 4-5 s less to start, cold; test_jax_ready holds
    the default to compiling them all first)."""
    argv = ("--framework", framework, "--weights", weights, "--dtype", "float64", "--max-batch", "4")
    return start_server(*argv, "--no-precompile")
