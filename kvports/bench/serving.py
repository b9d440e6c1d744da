"""`kvports bench --serve`: the serving benchmark. A fixed set of chat requests (prompts of mixed
lengths behind one shared system prompt, fixed output lengths, greedy) sent at 1, 4 and 16
concurrent clients to a `kvports serve` it starts on loopback for each port, and with --peers to
llama-cpp-python's own OpenAI server on the same GGUF file. Per row: requests/s, output tokens/s,
time to first token and inter-token latency (p50, p99), the prefix-cache hit rate and where the
engine's time went (its step timings, from /metrics); a table, --json, and with --plot a figure of
throughput against concurrency. Bounded: max(4, clients) requests a level, each at most REQUEST_S seconds.

Each level's user messages carry the level's tag, so a level finds in the prefix cache only the
system prompt (and what its own requests share), not the previous level's whole prompts. Every
server first answers 4 requests untimed, and on JAX each level runs once untimed first, with
prompts of the same lengths (it compiles its step programs for the level's shapes there).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvports.bench.measure import load_average
from kvports.registry import PORTS
from kvports.shared.errors import UserError, echo

LEVELS = (1, 4, 16)  # concurrent clients
MIN_REQUESTS = 4  # per level: the level's clients, at least this many
MAX_TOKENS = (16, 32)  # alternating: fixed output lengths (a stop at the end-of-turn id may end one sooner)
MAX_LENGTH = 512  # each kvports server's longest sequence
START_S = 600  # a server's start (JAX compiles a real model's warm-up programs)
REQUEST_S = 300  # one request, at most
SYSTEM = "You are a helpful assistant. Answer in full sentences, with details and examples."
TOPICS = [
    "the water cycle",
    "how a bicycle stays upright",
    "why the sky is blue",
    "the history of the printing press, from Gutenberg's workshop to the spread of books across Europe",
    "photosynthesis",
    "how vaccines train the immune system to recognise a virus it has never met",
    "the rules of chess",
    "what a compiler does, from the source text to the machine code a processor runs",
]
PEER = "llama.cpp server"
# What --serve keeps from the bench's flags; every other one must stay at its default.
SERVING_FLAGS = ("serve", "weights", "model", "frameworks", "dtype", "threads", "peers", "json", "plot")


@dataclass(frozen=True)
class ServingBench:
    frameworks: tuple[str, ...]
    weights: Path
    dtype: str
    threads: int | None
    peers: bool
    json: bool
    plot: Path | None


def requests(tag: str, count: int) -> list[tuple[list[dict[str, str]], int]]:
    """`count` chats: prompts of mixed lengths behind the shared system prompt."""
    chats = []
    for index in range(count):
        topic = TOPICS[index % len(TOPICS)]
        text = f"({tag}, question {index}) Explain {topic}."
        chats.append(
            ([{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}], MAX_TOKENS[index % 2])
        )
    return chats


# ---------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def environment(threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    if threads is not None:
        for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[name] = str(threads)
    return env


def started(command: list[str], threads: int | None) -> subprocess.Popen:
    """A server process; its stderr goes to a file (`.log`), not a pipe nobody reads while it runs (a
    full pipe would stop it)."""
    import tempfile

    log = tempfile.TemporaryFile()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=environment(threads))
    process.log = log  # type: ignore[attr-defined]
    return process


def start_kvports(framework: str, bench: ServingBench, port: int) -> subprocess.Popen:
    kvports = str(Path(sys.executable).with_name("kvports"))  # the command installed beside this Python
    command = [kvports, "serve", "--framework", framework, "--weights", str(bench.weights)]
    command += ["--dtype", bench.dtype, "--port", str(port), "--max-batch", str(max(LEVELS))]
    command += ["--max-length", str(MAX_LENGTH), "--max-queue", str(max(LEVELS))]
    if bench.threads is not None:
        command += ["--threads", str(bench.threads)]
    return started(command, bench.threads)


def start_peer(bench: ServingBench, port: int) -> subprocess.Popen:
    call = f"serve_llama_cpp({str(bench.weights)!r}, {bench.threads!r}, {port})"
    code = f"from kvports.bench.serving import serve_llama_cpp; {call}"
    return started([sys.executable, "-c", code], bench.threads)


def serve_llama_cpp(weights: str, threads: int | None, port: int) -> None:
    """llama-cpp-python's own OpenAI server on the GGUF file (its process: `start_peer`). Its model is
    loaded with use_extra_bufts off: the wheel's AMX repacking path crashes on some CPUs, and its
    settings do not reach that field, so the default parameters it starts from are changed here. It runs
    one request at a time; interrupt_requests off makes a new one wait instead of cutting the running one
    short (its default, for a single interactive user)."""
    import llama_cpp.llama_cpp as native
    import uvicorn
    from llama_cpp.server.app import create_app
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    default = native.llama_model_default_params

    def without_extra_buffers() -> Any:
        params = default()
        params.use_extra_bufts = False
        return params

    native.llama_model_default_params = without_extra_buffers
    count = threads if threads is not None else os.cpu_count() or 1
    model = ModelSettings(
        model=weights, model_alias="peer", n_ctx=MAX_LENGTH * 2, n_threads=count, n_threads_batch=count, verbose=False
    )
    app = create_app(
        server_settings=ServerSettings(host="127.0.0.1", port=port, interrupt_requests=False), model_settings=[model]
    )
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def wait_ready(process: subprocess.Popen, url: str) -> None:
    import httpx

    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise UserError(f"the server at {url} exited {process.returncode}: {read_error(process)}")
        try:
            if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(process)
    raise UserError(f"the server at {url} was not ready within {START_S} s")


def read_error(process: subprocess.Popen) -> str:
    """The last line the server wrote on stderr (its log file)."""
    log = process.log  # type: ignore[attr-defined]
    log.seek(0)
    lines = log.read().decode("utf-8", "replace").strip().splitlines()
    return lines[-1] if lines else "(no message)"


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)


# ---------------------------------------------------------------- clients


async def one_request(client: Any, url: str, model: str, messages: list, max_tokens: int, ours: bool) -> dict:
    """A streamed chat: its time to first token, its gaps between tokens, its output tokens."""
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    body["stream"] = True
    if ours:
        body["return_token_ids"] = True
    start = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=REQUEST_S) as answer:
        if answer.status_code != 200:
            raise UserError(f"{url} answered {answer.status_code}: {(await answer.aread())[:300]!r}")
        async for line in answer.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not chunk.get("choices"):
                continue
            choice = chunk["choices"][0]
            # ours: the chunk's token ids; llama-cpp-python's: one token a chunk with content
            count = len(choice.get("token_ids", [])) if ours else int(bool(choice.get("delta", {}).get("content")))
            if not count:
                continue
            now = time.perf_counter()
            if first is None:
                first = now
            elif last is not None:
                gaps.extend([(now - last) / count] * count)
            last = now
            tokens += count
    end = time.perf_counter()
    return {"ttft": (first or end) - start, "gaps": gaps, "tokens": tokens, "latency": end - start}


async def run_level(url: str, model: str, chats: list, concurrency: int, ours: bool) -> tuple[list[dict], float]:
    import httpx

    limits = httpx.Limits(max_connections=concurrency)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=limits) as client:

        async def gated(messages: list, max_tokens: int) -> dict:
            async with gate:
                return await one_request(client, url, model, messages, max_tokens, ours)

        start = time.perf_counter()
        results = await asyncio.wait_for(
            asyncio.gather(*(gated(*chat) for chat in chats)), REQUEST_S * len(chats) / concurrency
        )
        return list(results), time.perf_counter() - start


def scrape(url: str) -> dict[str, float]:
    """The kvports server's counters the rows use."""
    import httpx

    names = {
        "kvports_prefix_cache_hit_tokens_total": "cached",
        "kvports_prefill_computed_tokens_total": "prefill",
        'kvports_engine_step_seconds_total{kind="prefill"}': "prefill_s",
        'kvports_engine_step_seconds_total{kind="decode"}': "decode_s",
        'kvports_engine_steps_total{kind="decode"}': "decode_steps",
        "kvports_generation_tokens_total": "generated",
    }
    values = dict.fromkeys(names.values(), 0.0)
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in names:
            values[names[name]] = float(value)
    return values


def row_of(server: str, concurrency: int, results: list[dict], seconds: float, before: dict, after: dict) -> dict:
    ttft = np.asarray([result["ttft"] for result in results])
    gaps = np.asarray([gap for result in results for gap in result["gaps"]] or [np.nan])
    tokens = sum(result["tokens"] for result in results)
    row: dict[str, Any] = {
        "server": server,
        "concurrency": concurrency,
        "requests": len(results),
        "seconds": seconds,
        "requests_per_s": len(results) / seconds,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / seconds,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "itl_p50_s": float(np.nanpercentile(gaps, 50)),
        "itl_p99_s": float(np.nanpercentile(gaps, 99)),
        "prefix_hit_rate": None,
    }
    if after:
        delta = {name: after[name] - before.get(name, 0.0) for name in after}
        needed = delta["cached"] + delta["prefill"]
        row["prefix_hit_rate"] = delta["cached"] / needed if needed else 0.0
        row["engine_prefill_s"], row["engine_decode_s"] = delta["prefill_s"], delta["decode_s"]
        row["decode_ms_per_step"] = 1000 * delta["decode_s"] / delta["decode_steps"] if delta["decode_steps"] else None
        row["engine_busy"] = (delta["prefill_s"] + delta["decode_s"]) / seconds
    return row


def bench_server(
    name: str, process: subprocess.Popen, url: str, model: str, ours: bool, progress: Any, warm: bool = False
) -> list[dict]:
    rows = []
    try:
        wait_ready(process, url)
        # Every server's first requests pay for what a first use costs (pages of weights, buffers).
        asyncio.run(run_level(url, model, requests("warm 0", MIN_REQUESTS), MIN_REQUESTS, ours))
        for concurrency in LEVELS:
            count = max(MIN_REQUESTS, concurrency)
            if warm:  # JAX: the level's step shapes compiled before it is timed (the same prompt lengths)
                asyncio.run(run_level(url, model, requests(f"warm {concurrency}", count), concurrency, ours))
            before = scrape(url) if ours else {}
            chats = requests(f"time {concurrency}", count)
            results, seconds = asyncio.run(run_level(url, model, chats, concurrency, ours))
            rows.append(row_of(name, concurrency, results, seconds, before, scrape(url) if ours else {}))
            progress(rows[-1])
    except Exception as exc:
        stop(process)
        raise UserError(f"{name}: {type(exc).__name__}: {exc}; its last line: {read_error(process)}") from exc
    stop(process)
    return rows


# ---------------------------------------------------------------- the command


def serving_inputs(args: argparse.Namespace, changed: list[str]) -> ServingBench:
    """`kvports bench --serve ...`'s flags, checked: a GGUF file with a chat template, the ports asked for."""
    from kvports.bench.options import parse_choices, single_threads
    from kvports.bench.runners import FRAMEWORKS
    from kvports.formats.chat import gguf_template

    if changed:
        flags = ", ".join("--" + name.replace("_", "-") for name in changed)
        raise UserError(f"--serve runs its own request set, which takes no {flags}")
    if args.weights is None:
        raise UserError("--serve sends chat requests: give --model NAME or --weights FILE.gguf (a chat template)")
    gguf_template(args.weights)  # a GGUF file with a chat template, or its one-line refusal
    frameworks = tuple(name for name in parse_choices(args.frameworks, FRAMEWORKS, "frameworks") if name in PORTS)
    if not frameworks and not args.peers:
        raise UserError(
            f"--serve serves the ports ({','.join(PORTS)}); --frameworks {echo(args.frameworks)} names none"
        )
    threads = single_threads(args.threads, "--serve runs its servers at one thread count")
    return ServingBench(frameworks, args.weights, args.dtype, threads, args.peers, args.json, args.plot)


def run_serving(bench: ServingBench) -> int:
    import importlib.util

    for module in ("fastapi", "uvicorn", "httpx", "prometheus_client"):
        if importlib.util.find_spec(module) is None:
            raise UserError("kvports bench --serve needs the serve and test extras: pip install 'kvports[serve,test]'")
    load_before, start = load_average(), time.perf_counter()

    def progress(row: dict) -> None:
        if not bench.json:
            print(f"  {row['server']} x{row['concurrency']}: {row['output_tokens_per_s']:.1f} tok/s", file=sys.stderr)

    rows: list[dict] = []
    for framework in bench.frameworks:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        rows += bench_server(
            f"kvports {framework}", start_kvports(framework, bench, port), url, bench.weights.stem, True, progress
        )
    if bench.peers:
        if importlib.util.find_spec("llama_cpp") is None:
            print("llama.cpp server: not installed (pip install 'kvports[peers]')", file=sys.stderr)
        else:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            rows += bench_server(PEER, start_peer(bench, port), url, "peer", False, progress)
    result = {
        "settings": {
            "weights": str(bench.weights),
            "dtype": bench.dtype,
            "threads": bench.threads,
            "levels": list(LEVELS),
            "requests_per_level": [max(MIN_REQUESTS, level) for level in LEVELS],
            "max_tokens": list(MAX_TOKENS),
            "max_length": MAX_LENGTH,
        },
        "machine": {"cpu_count": os.cpu_count(), "load_average": [load_before, load_average()]},
        "seconds": time.perf_counter() - start,
        "rows": rows,
    }
    if bench.plot is not None:
        result["plots"] = [str(plot_throughput(rows, bench.plot))]
    print(json.dumps(result, indent=2) if bench.json else table(result))
    return 0


def table(result: dict) -> str:
    def ms(value: float | None) -> str:
        return "" if value is None else f"{1000 * value:.0f}"

    lines = [
        "| server | clients | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | prefix hits "
        "| engine busy | decode ms/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        hits = "" if row["prefix_hit_rate"] is None else f"{100 * row['prefix_hit_rate']:.0f}%"
        busy = f"{100 * row['engine_busy']:.0f}%" if "engine_busy" in row else ""
        step = f"{row['decode_ms_per_step']:.0f}" if row.get("decode_ms_per_step") is not None else ""
        lines.append(
            f"| {row['server']} | {row['concurrency']} | {row['requests_per_s']:.2f} "
            f"| {row['output_tokens_per_s']:.1f} "
            f"| {ms(row['ttft_p50_s'])} | {ms(row['ttft_p99_s'])} | {ms(row['itl_p50_s'])} | {ms(row['itl_p99_s'])} "
            f"| {hits} | {busy} | {step} |"
        )
    load = result["machine"]["load_average"]
    lines.append(f"\n{result['seconds']:.0f} s; load average {load[0]} at the start, {load[1]} at the end")
    return "\n".join(lines)


def plot_throughput(rows: list[dict], directory: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    figure, axis = plt.subplots(figsize=(6, 4))
    for server in dict.fromkeys(row["server"] for row in rows):
        mine = [row for row in rows if row["server"] == server]
        axis.plot(
            [row["concurrency"] for row in mine], [row["output_tokens_per_s"] for row in mine], "o-", label=server
        )
    axis.set_xscale("log", base=2)
    axis.set_xticks(list(LEVELS), [str(level) for level in LEVELS])
    axis.set_xlabel("concurrent clients")
    axis.set_ylabel("output tokens/s")
    axis.set_title("Serving throughput against concurrency")
    axis.grid(alpha=0.3)
    axis.legend()
    path = directory / "serving_throughput.png"
    temporary = path.with_suffix(".tmp.png")
    figure.savefig(temporary, dpi=120, bbox_inches="tight")
    plt.close(figure)
    os.replace(temporary, path)
    return path
