"""`kvports serve`: an OpenAI-compatible HTTP server over the continuous-batching engine (docs/SERVING.md).

Everything the user gave is checked before any framework code runs, as `kvports batch` checks it,
and the address is bound and listening; then the model loads, the engine runs one warm-up request
(JAX compiles its decode program and a one-row prefill program there, not on the first client's
request), and one line on stdout says where it listens. SIGINT or SIGTERM: it stops accepting,
lets running requests finish (--shutdown-timeout, then ends each with an error, a stream's last
chunk) and exits 0; a second signal ends them at once (kvports/server/connections.py).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from kvports.batching.arguments import add_engine_arguments
from kvports.batching.constraint import Grammars
from kvports.batching.engine import BatchSettings, Engine, EngineStats, run_bytes
from kvports.batching.request import Request
from kvports.commands import batch
from kvports.commands.batch import chat_of, load_tokenizer
from kvports.commands.check import seconds
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
from kvports.loading import header, load_model, open_model, read_tensors
from kvports.progress import make_progress
from kvports.registry import PORTS, REFERENCE
from kvports.shared.config import DTYPES, ModelConfig
from kvports.shared.errors import UserError, echo
from kvports.shared.generation import GenerationConfig
from kvports.threads import check_threads, use_threads
from kvports.validation import Setup, check_rules

HELP = "serve a model over HTTP with the OpenAI API (completions, chat, streaming), batching its requests"
MAX_BATCH = 16
MAX_LENGTH = 1024  # the default longest sequence: a model's whole context sizes a pool too large to hold
MAX_QUEUE = 64
GRACEFUL_S = 5.0  # how long running requests may finish after SIGINT or SIGTERM
HEADER_TIMEOUT_S = 10.0  # a request's headers, from its connection (or its first bytes after a previous request)
BODY_TIMEOUT_S = 30.0  # its body, from its headers: 4 MiB at 1 Mbit/s
LOOPBACK = "127.0.0.1"
BACKLOG = 2048  # connections waiting to be accepted (uvicorn's default)
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
    parser.add_argument(
        "--allowed-origins",
        type=origins,
        action="append",
        default=[],
        metavar="ORIGINS",
        help="origins a browser may call from (CORS), comma-separated or repeated, e.g. "
        "http://localhost:3000; '*' for any (default: none, as a browser page elsewhere gets no answer)",
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
    parser.add_argument(
        "--header-timeout",
        type=seconds,
        default=HEADER_TIMEOUT_S,
        metavar="S",
        help="a request's headers must arrive within S seconds of its connection opening, or of its first "
        f"bytes after a previous request; an idle connection closes after S (default {HEADER_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--body-timeout",
        type=seconds,
        default=BODY_TIMEOUT_S,
        metavar="S",
        help=f"a request's body must arrive within S seconds of its headers, else 408 (default {BODY_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=seconds,
        default=GRACEFUL_S,
        metavar="S",
        help="after SIGINT or SIGTERM running requests may finish for S seconds; then each ends with an error "
        f"(a stream's last chunk); a second signal ends them at once (default {GRACEFUL_S:g})",
    )
    parser.add_argument(
        "--precompile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="JAX: compile every program a step can run before saying ready, so no request waits on a "
        "compile (a fixed few: prefill runs in chunks of fixed widths; for SmolLM2 on 2 CPU cores 49 "
        "programs, ~5 minutes the first time, ~30 s from JAX's on-disk cache); --no-precompile: a faster "
        "start, each new step shape compiling when it first comes. "
        "Other frameworks: nothing to do (default: on)",
    )
    add_threads_argument(parser)


def origins(text: str) -> list[str]:
    """--allowed-origins' value: origins separated by commas (vLLM's flag, its values as Starlette's CORS takes)."""
    found = [origin.strip() for origin in text.split(",") if origin.strip()]
    if not found:
        raise OutOfRange("no origin given")
    return found


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
            make_server(app, state, args.host, args.port, args).run(sockets=[sock])
        finally:
            state.loop.stop()
    print("kvports serve: stopped", file=sys.stderr, flush=True)
    return 0


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening: an address this machine does not have, or a port in
    use, is a user error. It listens at once, before the model loads: with SO_REUSEADDR, two sockets
    that are only bound may share a port, and a second server started beside the first would load
    its model and fail only when it came to listen. A client that connects meanwhile waits in the
    backlog until the server is ready."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise UserError(f"cannot listen on --host {echo(host)} ({exc.strerror or exc})") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
    try:
        sock.bind((host, port))
        sock.listen(BACKLOG)
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

    with open_model(args.weights) as file:  # the header, checked before any tensor is read
        config = header(file, args.dtype)
        checked = check(config)
        tensors = read_tensors(file, args.dtype, args.quant)
    settings, tokenizer = checked
    use_threads(args.threads)
    loaded = load_model(args.framework, config, tensors, args.dtype, args.device, quant=args.quant)
    port = loaded.port if wrap_port is None else wrap_port(loaded.port)
    # The tokenizer as llguidance's, for requests with a response_format (built on the first one).
    grammars = None if tokenizer is None else Grammars(tokenizer, config.vocab_size, tuple(config.eos_token_ids))
    engine = Engine(port, loaded.model, config, settings, dtype=args.dtype, end_nonfinite_rows=True, grammars=grammars)
    warm_up(engine, args.precompile)
    context = min(settings.longest(config), settings.pool_blocks(config) * settings.block_size)
    limits = Limits(model_name(args), config.vocab_size, context, tuple(config.eos_token_ids), config)
    metrics = Metrics()
    metrics.blocks_free.set(engine.blocks.num_free)
    loop = EngineLoop(engine, metrics, args.max_queue)
    encode = None if tokenizer is None else (lambda text: tokenizer.encode(text).ids)
    state = ServerState(loop, metrics, limits, tokenizer, encode, chat_of(args.weights, tokenizer), args.api_key)
    state.created = int(time.time())
    state.describe = f"{args.framework}, model {limits.model}, context {context}"
    state.body_timeout = args.body_timeout
    state.allowed_origins = tuple(origin for given in args.allowed_origins for origin in given)
    return state, create_app(state)


def check_api_key(args: argparse.Namespace) -> None:
    """A key every client sends unchanged: visible ASCII. A header carries ASCII only, white space at
    its ends is stripped on its way and a control character refused. The key itself is never echoed."""
    key = args.api_key
    if key is None:
        return
    if not key.strip():
        raise UserError("--api-key is empty: give a key, or leave the flag out for none")
    for index, character in enumerate(key):
        if not "!" <= character <= "~":
            raise UserError(
                f"the API key (--api-key or $KVPORTS_API_KEY) holds U+{ord(character):04X} at character {index}: "
                "a key is visible ASCII ('!' to '~'), which every client sends unchanged in an HTTP header"
            )


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


def warm_up(engine: Engine, precompile: bool = True) -> None:
    """Before the server says it is ready: one short request runs through the engine (JAX compiles its
    decode program and a one-row prefill); then, unless --no-precompile, JAX compiles every other
    program a step can run (`Engine.compile_steps`), so no client waits on a compile. After a step,
    as every later step finds it: JAX keys its programs by whether each input is committed to a
    device, and a step's output pool is. The warm-up's counts are then forgotten."""
    prompt = tuple([0] * min(8, engine.settings.longest(engine.config) - 2))
    engine.add(Request("warm-up", prompt, GenerationConfig(max_new_tokens=2)))
    engine.run()
    if precompile:
        started = time.perf_counter()
        with make_progress(quiet=False) as progress:  # SmolLM2's programs: minutes on a CPU, the first time
            task = progress.add_task("compile")

            def compiled(done: int, total: int) -> None:
                progress.update(task, completed=done, total=total)

            programs = engine.compile_steps(compiled)
        if programs:
            seconds = time.perf_counter() - started
            print(f"kvports serve: compiled {programs} programs in {seconds:.1f} s", file=sys.stderr, flush=True)
    engine.stats = EngineStats()
    engine.blocks.peak_used = 0


def make_server(app: Any, state: Any, host: str, port: int, args: argparse.Namespace) -> Any:
    """uvicorn's server for the app, with the timeouts and the shutdown of kvports/server/connections.py."""
    from kvports.server.connections import Timeouts, make_server

    timeouts = Timeouts(args.header_timeout, args.body_timeout, args.shutdown_timeout)
    return make_server(app, host, port, state.describe, timeouts, state.end_requests)
