"""`kvports batch`: requests from a JSONL file, run with continuous batching over a paged KV cache.

stdout: one JSON line per finished request (in finishing order), then one summary line.
stderr: one `error: line N: ...` line per bad request line (the others still run; the exit
status is then 2), and a progress bar while it runs (on a terminal).
Everything the user gave is checked before any framework code runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvports.batching.arguments import add_engine_arguments
from kvports.batching.blocks import blocks_for
from kvports.batching.constraint import Grammars
from kvports.batching.engine import (
    MAX_BATCH,
    BatchSettings,
    Engine,
    run_bytes,
)
from kvports.batching.request import Chat, Request
from kvports.batching.request_file import BadLine, parse_requests, split_lines
from kvports.batching.scheduler import Sequence
from kvports.bench.presets import PRESETS
from kvports.bench.throughput import WORKLOADS, BatchingBench, choices, run_bench
from kvports.devices import add_device_argument
from kvports.flags import (
    add_quant_argument,
    add_tensor_parallel_argument,
    add_threads_argument,
    add_weights_arguments,
    positive_int,
)
from kvports.limits import check_bytes, check_count
from kvports.loading import header, load_model, open_model, read_tensors
from kvports.progress import make_progress
from kvports.registry import PORTS, REFERENCE
from kvports.shared.config import DTYPES, ModelConfig
from kvports.shared.errors import UserError, echo_path
from kvports.threads import check_threads, use_threads
from kvports.validation import Setup, check_rules

HELP = "run a JSONL file of requests with continuous batching over a paged KV cache (or --bench it)"
EXIT_BAD_LINES = 2  # a user error, as every other: some lines were not run
DEFAULT_NEW_TOKENS = 16
# Parsed, a token id of a few JSON characters becomes a 28-byte int and an 8-byte list slot.
PARSED_BYTES_PER_BYTE = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--requests",
        type=Path,
        metavar="FILE",
        help='JSONL, one request a line: {"prompt": [ids]}, {"text": "..."} or {"messages": [{"role", "content"}]} '
        '(a GGUF file\'s chat template), and optionally "id", '
        '"max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop_ids" (default: the model\'s eos ids)',
    )
    parser.add_argument("--framework", choices=PORTS, default=REFERENCE, help=f"default {REFERENCE}")
    add_weights_arguments(parser)
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="compute dtype (default float32)")
    add_quant_argument(parser)
    add_device_argument(parser)
    add_tensor_parallel_argument(parser)
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        metavar="DIR",
        help="folder holding tokenizer.json: encodes 'text' prompts, decodes every output",
    )
    parser.add_argument(
        "--new-tokens",
        type=positive_int,
        default=DEFAULT_NEW_TOKENS,
        metavar="N",
        help=f"max_new_tokens of a line that gives none (default {DEFAULT_NEW_TOKENS})",
    )
    add_engine_arguments(parser, MAX_BATCH, "--max-batch of the longest request")
    add_threads_argument(parser)
    bench = parser.add_argument_group("benchmark (--bench: no --requests; see docs/BATCHING.md)")
    bench.add_argument(
        "--bench",
        action="store_true",
        help="time continuous batching against the same requests one after another, per framework",
    )
    bench.add_argument("--frameworks", default=",".join(PORTS), help="--bench: comma-separated (default all)")
    bench.add_argument(
        "--preset",
        choices=tuple(PRESETS),
        default="gpt2-small",
        help="--bench: the model (default gpt2-small: GPT-2 small as published, random weights); --weights FILE "
        "times that file instead",
    )
    bench.add_argument("--count", type=positive_int, default=32, help="--bench: requests per workload (default 32)")
    bench.add_argument("--workloads", default="mixed,prefix", help="--bench: mixed, prefix or both (default both)")
    bench.add_argument("--json", action="store_true", help="--bench: one JSON object on stdout instead of the table")


def settings_of(args: argparse.Namespace, max_length: int | None) -> BatchSettings:
    return BatchSettings(
        max_batch=args.max_batch,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_step_tokens=args.max_step_tokens,
        prefix_caching=not args.no_prefix_cache,
        max_length=max_length,
    )


# What the batch runs: the engine's paged steps (a torch split has no paged cache to share).
MODES = ("paged",)


def run(args: argparse.Namespace) -> int:
    if args.bench:
        if args.requests is not None:
            raise UserError("give --requests FILE or --bench (it makes its own requests), not both")
        if args.quant != "none":
            raise UserError(f"--bench times float weights; --quant {args.quant} is for --requests FILE")
        if args.tensor_parallel != 1:
            raise UserError(
                f"--bench times one device; --tensor-parallel {args.tensor_parallel} is for --requests FILE"
            )
        return run_bench(bench_inputs(args))
    if args.requests is None:
        raise UserError("give --requests FILE.jsonl (or --bench)")
    check_threads(args.threads)
    setup = Setup((args.framework,), MODES, args.dtype, args.quant, args.device, args.tensor_parallel)

    def check(config: ModelConfig) -> tuple[BatchSettings, Any, list[Request], list[BadLine]]:
        check_rules(setup, models=[("the model", config)])
        # The flags, before the file: they decide what fits. The default pool is sized below, for the
        # requests' own lengths: a model's long context must not refuse a file of short requests.
        settings_of(args, 1).validate(config)
        tokenizer = load_tokenizer(args.tokenizer, args.weights, config)
        requests, bad = read_requests(args, config, tokenizer)
        for line in bad:
            print(f"error: {line}", file=sys.stderr)
        if not requests:
            raise UserError(f"no request to run in {echo_path(args.requests)}")
        settings = settings_of(args, max(request.max_length for request in requests)).validate(config)
        check_bytes(run_bytes(config, args.dtype, settings), f"a batch of {len(requests)} requests in {args.dtype}")
        return settings, tokenizer, requests, bad

    with open_model(args.weights) as file:  # the header, checked before any tensor is read
        config = header(file, args.dtype)
        checked = check(config)
        tensors = read_tensors(file, args.dtype, args.quant)
    settings, tokenizer, requests, bad = checked
    use_threads(args.threads)
    loaded = load_model(
        args.framework,
        config,
        tensors,
        args.dtype,
        args.device,
        quant=args.quant,
        tensor_parallel=args.tensor_parallel,
    )
    summary = run_requests(loaded.port, loaded.model, config, settings, requests, tokenizer, dtype=args.dtype)
    summary.update(
        framework=args.framework, dtype=args.dtype, device=args.device, threads=args.threads, bad_lines=len(bad)
    )
    summary.update(tensor_parallel=args.tensor_parallel, quant=args.quant)
    print(json.dumps({"summary": summary}), flush=True)
    return EXIT_BAD_LINES if bad else 0


def bench_inputs(args: argparse.Namespace) -> BatchingBench:
    """--bench's flags as the batching bench's inputs."""
    check_count("--count", args.count)  # as bench --requests bounds its own
    return BatchingBench(
        tuple(choices(args.frameworks, PORTS, "frameworks")),
        tuple(choices(args.workloads, WORKLOADS, "workloads")),
        args.count,
        BatchSettings(args.max_batch, args.block_size, args.num_blocks, args.max_step_tokens),
        args.preset,
        args.weights,
        args.dtype,
        args.device,
        args.json,
        args.threads,
    )


def load_tokenizer(path: Path | None, weights: Path | None, config: ModelConfig) -> Any:
    """--tokenizer DIR's, else a GGUF weights file's own; None when there is neither."""
    from kvports.formats.gguf.tokenizer import gguf_tokenizer, has_tokenizer
    from kvports.formats.hf.text import check_vocabulary
    from kvports.formats.hf.text import load_tokenizer as load

    if path is not None:
        return check_vocabulary(load(path), config.vocab_size)
    if weights is not None and has_tokenizer(weights):
        return check_vocabulary(gguf_tokenizer(weights), config.vocab_size)
    return None


def read_requests(args: argparse.Namespace, config: ModelConfig, tokenizer: Any) -> tuple[list[Request], list[BadLine]]:
    path: Path = args.requests
    try:
        if not path.is_file():
            exists = path.exists()
            raise UserError(
                f"requests file {echo_path(path)} {'is not a regular file' if exists else 'does not exist'}"
            )
        size = path.stat().st_size
    except OSError as exc:  # a name too long, say
        raise UserError(f"cannot read {echo_path(path)} ({exc.strerror or exc})") from None
    check_bytes({"requests file": size, "parsed requests": PARSED_BYTES_PER_BYTE * size}, f"reading {echo_path(path)}")
    try:
        lines = split_lines(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"requests file {echo_path(path)} is not UTF-8 text") from None
    if not any(line.strip() for line in lines):
        raise UserError(f"requests file {echo_path(path)} has no requests")
    encode = None if tokenizer is None else (lambda text: tokenizer.encode(text).ids)
    # A request the pool could never hold is a bad line, not a run that waits forever.
    pool_tokens = None if args.num_blocks is None else args.num_blocks * args.block_size
    return parse_requests(lines, config, args.new_tokens, encode, pool_tokens, chat_of(args.weights, tokenizer))


def chat_of(weights: Path | None, tokenizer: Any) -> Chat | None:
    """ "messages" lines' encoder: a GGUF weights file's chat template with the tokenizer; None without either."""
    from kvports.formats.gguf.reader import is_gguf

    if weights is None or tokenizer is None or not is_gguf(weights):
        return None
    from kvports.formats.chat import chat_encoder

    return chat_encoder(weights, tokenizer)


def run_requests(
    port: Any,
    model: Any,
    config: ModelConfig,
    settings: BatchSettings,
    requests: list[Request],
    tokenizer: Any,
    *,
    dtype: str = "float32",
) -> dict[str, Any]:
    """Run every request, printing each one's line as it finishes; the summary."""
    # A line's response_format is masked by the tokenizer's grammar (built only when a line asks).
    grammars = None if tokenizer is None else Grammars(tokenizer, config.vocab_size, tuple(config.eos_token_ids))
    engine = Engine(port, model, config, settings, dtype=dtype, grammars=grammars)
    start = time.perf_counter()
    for request in requests:
        engine.add(request)
    with make_progress(quiet=False) as progress:
        task = progress.add_task("batch", total=len(requests))

        def report(sequence: Sequence) -> None:
            print(json.dumps(result_line(sequence, tokenizer)), flush=True)
            progress.advance(task)

        finished = engine.run(on_finish=report)
    return summarize(engine, finished, time.perf_counter() - start)


def result_line(sequence: Sequence, tokenizer: Any) -> dict[str, Any]:
    assert sequence.first_token_time is not None and sequence.finish_time is not None
    line: dict[str, Any] = {
        "id": sequence.request.id,
        "tokens": sequence.generated,  # the new tokens; a stopped request's last one is its stop token
        "finish_reason": sequence.finish_reason,
        "ttft_s": sequence.first_token_time - sequence.arrival,
        "latency_s": sequence.finish_time - sequence.arrival,
        "prompt_tokens": len(sequence.request.prompt),
        "cached_tokens": sequence.cached_tokens,
        "preemptions": sequence.preemptions,
    }
    if tokenizer is not None:
        from kvports.formats.hf.text import decode

        line["text"] = decode(tokenizer, sequence.generated)
    return line


def summarize(engine: Engine, finished: list[Sequence], seconds: float) -> dict[str, Any]:
    stats, blocks = engine.stats, engine.blocks
    generated = sum(len(sequence.generated) for sequence in finished)
    ttft = [
        sequence.first_token_time - sequence.arrival for sequence in finished if sequence.first_token_time is not None
    ]
    latency = [sequence.finish_time - sequence.arrival for sequence in finished if sequence.finish_time is not None]
    return {
        "requests": len(finished),
        "seconds": seconds,
        "requests_per_s": len(finished) / seconds,
        "tokens_per_s": generated / seconds,
        "generated_tokens": generated,
        "prompt_tokens": sum(len(sequence.request.prompt) for sequence in finished),
        "prefill_tokens": stats.prefill_tokens,
        "padded_prefill_tokens": stats.padded_prefill_tokens,
        "cached_tokens": stats.cached_tokens,
        "prefix_hit_rate": stats.prefix_hit_rate,
        "steps": dict(stats.steps),
        "preemptions": stats.preemptions,
        "ttft_s": percentiles(ttft),
        "latency_s": percentiles(latency),
        "blocks": {
            "num_blocks": blocks.num_blocks,
            "block_size": blocks.block_size,
            "peak_used": blocks.peak_used,
            "peak_usage": blocks.peak_used / blocks.num_blocks,
            "free_after": blocks.num_free,
            "blocks_per_sequence": blocks_for(engine.settings.longest(engine.config), blocks.block_size),
        },
    }


def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    array = np.asarray(values, dtype=np.float64)
    return {"median": float(np.median(array)), "p90": float(np.percentile(array, 90)), "max": float(array.max())}
