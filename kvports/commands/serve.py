"""`kvports serve`: an OpenAI-compatible HTTP server over the continuous-batching engine (docs/SERVING.md).

Everything the user gave is checked before any framework code runs, as `kvports batch` checks it,
and the address is bound; then the model loads, the engine runs one warm-up request (JAX compiles
its decode program and a one-row prefill program there, not on the first client's request), and
one line on stdout says where it listens. SIGINT or SIGTERM: it stops accepting, lets running
requests finish (a few seconds at most, then cancels them) and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvports.batching.arguments import add_engine_arguments
from kvports.batching.engine import BatchSettings, Engine, EngineStats, run_bytes
from kvports.batching.request import Request
from kvports.commands import batch
from kvports.commands.batch import chat_of, load_tokenizer
from kvports.devices import add_device_argument
from kvports.flags import (
    OutOfRange,
    add_quant_argument,
    add_threads_argument,
    add_weights_arguments,
    non_negative_int,
    positive_int,
)
from kvports.limits import check_bytes
from kvports.registry import PORTS, REFERENCE
from kvports.run import load_model, read_model
from kvports.shared.config import DTYPES, ModelConfig
from kvports.shared.errors import UserError, echo
from kvports.shared.generation import GenerationConfig
from kvports.threads import check_threads, use_threads
from kvports.validation import Setup, check_rules

HELP = "serve a model over HTTP with the OpenAI API (completions, chat, streaming), batching its requests"
MAX_BATCH = 16
MAX_LENGTH = 1024  # the default longest sequence: a model's whole context sizes a pool too large to hold
MAX_QUEUE = 64
GRACEFUL_S = 5  # how long running requests may finish after SIGINT or SIGTERM
LOOPBACK = "127.0.0.1"
MAX_PORT = 65535
INSTALL = "kvports serve needs FastAPI, uvicorn and prometheus-client: pip install 'kvports[serve]'"
# What the server runs: the engine's paged steps (as `kvports batch`).
MODES = ("paged",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--framework", choices=PORTS, default=REFERENCE, help=f"default {REFERENCE}")
    add_weights_arguments(parser)
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype (default float32)")
    add_quant_argument(parser)
    add_device_argument(parser)
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        metavar="DIR",
        help="folder holding tokenizer.json (default: a GGUF file's own)",
    )
    parser.add_argument(
        "--host", default=LOOPBACK, help=f"address to listen on (default {LOOPBACK}: this machine only)"
    )
    parser.add_argument(
        "--port", type=port_number, default=8000, help="TCP port (default 8000; 0: any free port, printed when ready)"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("KVPORTS_API_KEY"),
        help="ask /v1/ requests for 'Authorization: Bearer KEY' (default: $KVPORTS_API_KEY; none: no key)",
    )
    add_engine_arguments(parser, MAX_BATCH, "--max-batch sequences of --max-length")
    parser.add_argument(
        "--max-length",
        type=positive_int,
        default=None,
        help=f"the longest sequence, prompt and new tokens (default: the model's context, at most {MAX_LENGTH})",
    )
    parser.add_argument(
        "--max-queue",
        type=positive_int,
        default=MAX_QUEUE,
        help=f"requests waiting beyond the batch before new ones get 429 (default {MAX_QUEUE})",
    )
    add_threads_argument(parser)


def port_number(text: str) -> int:
    value = non_negative_int(text)
    if value > MAX_PORT:
        raise OutOfRange(f"{value} is above {MAX_PORT}")
    return value


def run(args: argparse.Namespace) -> int:
    require_extra()
    sock = listen(args.host, args.port)  # before the model loads: a port in use is one line, at once
    with sock:
        state, app = prepare(args)
        state.loop.start()
        try:
            make_server(app, args.host, args.port, state.describe).run(sockets=[sock])
        finally:
            state.loop.stop()
    print("kvports serve: stopped", file=sys.stderr, flush=True)
    return 0


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound: an address this machine does not have, or a port in use, is a user error."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise UserError(f"cannot listen on --host {echo(host)} ({exc.strerror or exc})") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    return sock


def require_extra() -> None:
    """The serve extra's packages, or the one line that says how to install them."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UserError(INSTALL) from None


def prepare(args: argparse.Namespace, wrap_port: Any = None) -> tuple[Any, Any]:
    """The server's state and its FastAPI app, the model loaded and the engine warmed up (its loop not
    yet started). wrap_port: a test's wrapper around the port (a slow or failing step)."""
    from kvports.server.app import ServerState, create_app
    from kvports.server.loop import EngineLoop
    from kvports.server.metrics import Metrics
    from kvports.server.schemas import Limits

    check_threads(args.threads)
    check_api_key(args)
    setup = Setup((args.framework,), MODES, args.dtype, args.quant, args.device, 1)

    def check(config: ModelConfig) -> tuple[BatchSettings, Any]:
        check_rules(setup, models=[("the model", config)])
        settings = settings_of(args, config).validate(config)
        check_bytes(run_bytes(config, args.dtype, settings), f"a server's block pool in {args.dtype}")
        return settings, load_tokenizer(args.tokenizer, args.weights, config)

    config, tensors, checked = read_model(args.weights, args.dtype, check, args.quant)
    assert checked is not None
    settings, tokenizer = checked
    use_threads(args.threads)
    loaded = load_model(args.framework, config, tensors, args.dtype, args.device, quant=args.quant)
    port = loaded.port if wrap_port is None else wrap_port(loaded.port)
    engine = Engine(port, loaded.model, config, settings, dtype=args.dtype, end_nonfinite_rows=True)
    warm_up(engine)
    context = min(settings.longest(config), settings.pool_blocks(config) * settings.block_size)
    limits = Limits(model_name(args), config.vocab_size, context, tuple(config.eos_token_ids), config)
    metrics = Metrics()
    metrics.blocks_free.set(engine.blocks.num_free)
    loop = EngineLoop(engine, metrics, args.max_queue)
    encode = None if tokenizer is None else (lambda text: tokenizer.encode(text).ids)
    state = ServerState(loop, metrics, limits, tokenizer, encode, chat_of(args.weights, tokenizer), args.api_key)
    state.created = int(time.time())
    state.describe = f"{args.framework}, model {limits.model}, context {context}"
    return state, create_app(state)


def check_api_key(args: argparse.Namespace) -> None:
    if args.api_key is not None and not args.api_key.strip():
        raise UserError("--api-key is empty: give a key, or leave the flag out for none")


def settings_of(args: argparse.Namespace, config: ModelConfig) -> BatchSettings:
    """The engine's settings: `kvports batch`'s flags, and the longest sequence (--max-length)."""
    length = args.max_length if args.max_length is not None else min(config.max_seq_len, MAX_LENGTH)
    if length > config.max_seq_len:
        raise UserError(f"--max-length {length} exceeds the model's context (max_seq_len) {config.max_seq_len}")
    return batch.settings_of(args, length)


def model_name(args: argparse.Namespace) -> str:
    """The name clients give as "model": --model NAME's, else the weights file's name."""
    if getattr(args, "model", None):
        return str(args.model)
    return args.weights.stem if args.weights is not None else "kvports-seed"


def warm_up(engine: Engine) -> None:
    """One short request through the engine before the server says it is ready: JAX compiles its
    decode program (every decode step's) and a one-row prefill program here, not on a client's first
    request; a prefill shape not seen yet compiles when it first comes. Its counts are then forgotten."""
    prompt = tuple([0] * min(8, engine.settings.longest(engine.config) - 2))
    engine.add(Request("warm-up", prompt, GenerationConfig(max_new_tokens=2)))
    engine.run()
    engine.stats = EngineStats()
    engine.blocks.peak_used = 0


def make_server(app: Any, host: str, port: int, what: str) -> Any:
    """uvicorn's server for the app: one line on stdout once it listens; SIGINT or SIGTERM end it
    cleanly (its run returns, and the command exits 0, not by the signal)."""
    import threading

    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                bound, number = self.servers[0].sockets[0].getsockname()[:2]
                self.url = f"http://{f'[{bound}]' if ':' in bound else bound}:{number}"
                print(f"kvports serve: ready on {self.url} ({what})", flush=True)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn's own re-raises the signal once it has stopped, which ends the process by it.
            if threading.current_thread() is not threading.main_thread():  # a test's server: no signals
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_S,
        lifespan="off",
    )
    return Server(config)
