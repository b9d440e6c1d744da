"""`make eval`: lm-eval's own `local-completions` model, run against `kvports serve` for each port
on SmolLM2-135M-Instruct at float32, on the project's own multiple-choice task (tools/eval/: 42
questions, 4 choices each); beside them, where llama_cpp is installed, llama.cpp's log-likelihoods of
the same requests from llama-cpp-python's library (`llama_cpp_items`), and with --peer-server its own
server through lm-eval. Then the per-item comparison lm-eval's table does not give: does every port
choose the same answer for every item, and how far apart are the log-likelihoods it chose by.

Each server is started alone (loopback, a free port, the threads given), waited for, measured
(lm-eval's wall time, the load average from before to after), and stopped before the next. lm-eval
runs as a subprocess of this Python (the `eval` extra: pip install -e '.[eval]'), offline
(HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1: the task is a local JSONL file, the tokenizer is the GGUF
file's own, written by `kvports convert --from-gguf --tokenizer-out`), with --log_samples: each
item's per-choice log-likelihoods are read back from its samples file. kvports' servers get the
prompts as token ids (tokenized_requests=True); llama-cpp-python's server takes text only, so it
gets the same tokens decoded (the GGUF file adds no BOS, so its positions line up).

    python tools/eval_ports.py [--frameworks numpy,torch,jax] [--threads 2] [--concurrent 1]
        [--out build/eval] [--json docs/data/eval_smollm2.json] [--limit N] [--no-peer] [--peer-server]
    python tools/eval_ports.py --table [FILE]   # the table of a --json file (default: the committed run)

Exit 0 when every kvports port chose the same answer for every item, 1 otherwise, 2 on a usage
error (no lm-eval, no fetched model).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvports.bench.serving import ServingBench

ROOT = Path(__file__).resolve().parents[1]
TASK = "kvports_mc"
TASK_DIR = ROOT / "tools" / "eval"
REFERENCE = "kvports torch"  # the reference port: every other server is compared with it
# llama-cpp-python's library on the token ids kvports got: on the GGUF file itself as llama.cpp runs it by
# default (on its Q4_1 blocks, a float16 KV cache), and on the F32 GGUF file kvports writes from the weights
# every port runs (bench --peers') with a float32 cache: the same arithmetic as the ports.
PEER = "llama.cpp Q4_1 (library)"
PEER_F32 = "llama.cpp F32, F32 cache (library)"
# llama-cpp-python's own server through lm-eval (--peer-server): its echoed prompt's log-probabilities are
# shifted by one position (llama_cpp_items says how), so its row shows what lm-eval gets from it, not a model.
PEER_SERVER = "llama.cpp server"
RESULTS = ROOT / "docs" / "data" / "eval_smollm2.json"  # the committed run, docs/SERVING.md's table
LM_EVAL_S = 1800  # one server's whole lm-eval run, at most


@dataclass(frozen=True)
class Item:
    """One question as lm-eval scored it on one server."""

    target: int  # the right choice's index
    loglikelihoods: tuple[float, ...]  # each choice's summed log-probability, in the task's order
    lengths: tuple[int, ...]  # each choice's characters (without the space before it), acc_norm's divisors


def chosen(item: Item, normalised: bool = False) -> int:
    """The choice lm-eval's acc (or acc_norm) picks: the largest log-likelihood (per character), the
    first on a tie (numpy's argmax, as lm-eval's)."""
    values = list(item.loglikelihoods)
    if normalised:
        values = [value / length for value, length in zip(values, item.lengths, strict=True)]
    return max(range(len(values)), key=lambda index: (values[index], -index))


def read_samples(folder: Path) -> dict[int, Item]:
    """lm-eval's --log_samples file under `folder` (the newest), as items by doc_id."""
    files = sorted(folder.rglob(f"samples_{TASK}_*.jsonl"), key=lambda path: path.stat().st_mtime)
    if not files:
        raise SystemExit(f"error: lm-eval wrote no samples file under {folder}")
    items = {}
    for line in files[-1].read_text().splitlines():
        record = json.loads(line)
        choices = record["doc"]["choices"]
        item = Item(
            target=int(record["target"]),
            loglikelihoods=tuple(float(response[0]) for response in record["filtered_resps"]),
            lengths=tuple(len(choice) for choice in choices),
        )
        if "acc" in record and float(chosen(item) == item.target) != record["acc"]:  # lm-eval's own verdict
            raise SystemExit(f"error: item {record['doc_id']}: lm-eval's acc {record['acc']} is not this script's")
        items[int(record["doc_id"])] = item
    return items


def read_requests(folder: Path) -> dict[int, list[tuple[str, str]]]:
    """Each item's (context, continuation) pairs, one per choice, as lm-eval sent them."""
    files = sorted(folder.rglob(f"samples_{TASK}_*.jsonl"), key=lambda path: path.stat().st_mtime)
    requests = {}
    for line in files[-1].read_text().splitlines():
        record = json.loads(line)
        pairs = [(request["arg_0"], request["arg_1"]) for request in record["arguments"].values()]
        requests[int(record["doc_id"])] = pairs
    return requests


def encode_pair(encode: Callable[[str], list[int]], context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a request into tokens (TemplateLM._encode_pair, causal): trailing spaces of
    the context move to the continuation, the whole is encoded, and the context's tokens are cut off."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, start = encode(context + continuation), encode(context)
    return start, whole[len(start) :]


def max_delta(first: dict[int, Item], second: dict[int, Item]) -> float:
    """The largest |difference| of one choice's log-likelihood between two servers, over every item."""
    return max(
        abs(a - b) for doc in first for a, b in zip(first[doc].loglikelihoods, second[doc].loglikelihoods, strict=True)
    )


def margin(item: Item) -> float:
    """How far the chosen answer's log-likelihood is above the next one's: a server whose values are
    within half of it of these chooses the same."""
    best, second = sorted(item.loglikelihoods, reverse=True)[:2]
    return best - second


def compare(runs: dict[str, dict[int, Item]], reference: str = REFERENCE) -> dict:
    """Per server: accuracy, acc_norm, the items where it chose as the reference did and the largest
    log-likelihood distance from it; across kvports' ports: the items where every port chose alike,
    the largest distance between any two ports, and the reference's closest call (its smallest margin)."""
    docs = sorted(runs[reference])
    for name, items in runs.items():
        if sorted(items) != docs:
            raise SystemExit(f"error: {name} scored items {sorted(items)[:5]}..., the reference {docs[:5]}...")
    servers = {}
    for name, items in runs.items():
        servers[name] = {
            "accuracy": sum(chosen(items[doc]) == items[doc].target for doc in docs) / len(docs),
            "acc_norm": sum(chosen(items[doc], True) == items[doc].target for doc in docs) / len(docs),
            "same_choice_as_reference": sum(chosen(items[doc]) == chosen(runs[reference][doc]) for doc in docs),
            "max_abs_delta_vs_reference": max_delta(items, runs[reference]),
        }
    ports = [name for name in runs if name.startswith("kvports ")]
    agreed = [doc for doc in docs if len({chosen(runs[name][doc]) for name in ports}) == 1]
    pairs = {f"{a} / {b}": max_delta(runs[a], runs[b]) for a, b in combinations(ports, 2)}
    closest = min(docs, key=lambda doc: margin(runs[reference][doc]))
    return {
        "reference": reference,
        "items": len(docs),
        "servers": servers,
        "ports": ports,
        "ports_agree_on": len(agreed),
        "ports_disagree_on": [doc for doc in docs if doc not in agreed],
        "max_abs_delta_between_ports": max(pairs.values(), default=0.0),
        "pairs": pairs,
        "closest_call": {"doc_id": closest, "margin": margin(runs[reference][closest])},
    }


def per_item(runs: dict[str, dict[int, Item]]) -> list[dict]:
    """Every item's target, and each server's choice and log-likelihoods (the JSON's detail)."""
    first = next(iter(runs.values()))
    return [
        {
            "doc_id": doc,
            "target": first[doc].target,
            "chosen": {name: chosen(items[doc]) for name, items in runs.items()},
            "loglikelihoods": {name: list(items[doc].loglikelihoods) for name, items in runs.items()},
        }
        for doc in sorted(first)
    ]


def figure(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds:.1f}"


def markdown(report: dict, timings: dict[str, dict]) -> str:
    """The table docs/SERVING.md pastes: a row per server."""
    total = report["items"]
    lines = [
        f"| server | accuracy | acc_norm | same choice as {report['reference']} | max \\|Δ log-likelihood\\| "
        "| seconds | start s | load before, after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in report["servers"].items():
        timing = timings.get(name, {})
        load = timing.get("load_average", [None, None])
        lines.append(
            f"| {name} | {row['accuracy']:.3f} | {row['acc_norm']:.3f} | {row['same_choice_as_reference']}/{total} "
            f"| {row['max_abs_delta_vs_reference']:.2e} | {figure(timing.get('seconds'))} "
            f"| {figure(timing.get('start_seconds'))} | {load[0]}, {load[1]} |"
        )
    verdict = "the same answer" if report["ports_agree_on"] == total else "different answers"
    lines.append("")
    lines.append(
        f"kvports' ports ({', '.join(report['ports'])}) chose {verdict} on {report['ports_agree_on']}/{total} "
        f"items; the largest |Δ log-likelihood| between two ports: {report['max_abs_delta_between_ports']:.2e}; "
        f"{report['reference']}'s closest call (item {report['closest_call']['doc_id']}): its two likeliest "
        f"choices {report['closest_call']['margin']:.2e} apart."
    )
    return "\n".join(lines)


# ---------------------------------------------------------------- running


def llama_cpp_items(
    weights: Path, tokenizer: Path, reference: Path, items: dict[int, Item], threads: int, f32_cache: bool = False
) -> dict:
    """llama.cpp's log-likelihoods of the very token ids lm-eval sent kvports (the reference run's
    requests, split as lm-eval splits them), from llama-cpp-python's library: one forward of each
    request with every position's logits (logits_all), their log-softmax in float64. Not through its
    server: llama-cpp-python's /v1/completions scores an echoed prompt's token i by the distribution
    after it (llama.py: `logits_to_logprobs(self._scores)[token_offset:]`, token_offset 0 with echo)
    and drops the completion's token, so lm-eval's sums from it are not log-likelihoods. f32_cache: keys
    and values kept in float32 (llama.cpp's default cache is float16, 1e-2 off the ports' sums here)."""
    import llama_cpp
    import llama_cpp.llama_cpp as native
    import numpy as np
    from llama_cpp import Llama
    from tokenizers import Tokenizer

    default = native.llama_model_default_params

    def without_extra_buffers() -> object:  # the wheel's AMX repacking crashes on some CPUs (kvports bench)
        params = default()
        params.use_extra_bufts = False
        return params

    native.llama_model_default_params = without_extra_buffers
    cache = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32} if f32_cache else {}
    model = Llama(
        str(weights), n_ctx=512, n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False, **cache
    )
    hf = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))

    def encode(text: str) -> list[int]:
        return hf.encode(text, add_special_tokens=False).ids

    scored = {}
    for doc, pairs in read_requests(reference).items():
        values = []
        for context, continuation in pairs:
            start, rest = encode_pair(encode, context, continuation)
            model.reset()
            model.eval(start + rest)
            logits = np.asarray(model.scores[: len(start) + len(rest)], dtype=np.float64)  # [T, V]
            shifted = logits - logits.max(axis=-1, keepdims=True)
            logprobs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))  # [T, V]
            values.append(float(sum(logprobs[len(start) + index - 1, token] for index, token in enumerate(rest))))
        scored[doc] = Item(items[doc].target, tuple(values), items[doc].lengths)
    return scored


def lm_eval_command(url: str, model: str, tokenizer: Path, tokenized: bool, concurrent: int, out: Path) -> list[str]:
    model_args = (
        f"model={model},base_url={url}/v1/completions,tokenizer={tokenizer},tokenizer_backend=huggingface,"
        f"tokenized_requests={tokenized},num_concurrent={concurrent},max_retries=1,timeout=600"
    )
    return [
        str(Path(sys.executable).with_name("lm_eval")),
        *("--model", "local-completions", "--model_args", model_args),
        *("--tasks", TASK, "--include_path", str(TASK_DIR.relative_to(ROOT))),
        *("--log_samples", "--output_path", str(out)),
    ]


def run_lm_eval(command: list[str], out: Path) -> float:
    """lm-eval from the repository root (the task's data path is relative to it), offline; its
    output to out/lm_eval.log. Its wall time."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    with open(out / "lm_eval.log", "wb") as log:
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=LM_EVAL_S)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        tail = (out / "lm_eval.log").read_text(errors="replace").strip().splitlines()[-5:]
        raise SystemExit(f"error: lm_eval exited {done.returncode} ({out / 'lm_eval.log'}):\n" + "\n".join(tail))
    return seconds


def folder_of(settings: argparse.Namespace, name: str) -> Path:
    """Where lm-eval writes a server's run."""
    return settings.out / name.replace(" ", "-").replace(".", "")


def evaluate_server(
    name: str, process: subprocess.Popen, url: str, model: str, settings: argparse.Namespace
) -> tuple[dict[int, Item], dict]:
    """A started server's process: waited for, lm-eval run against it, stopped."""
    from kvports.bench.measure import load_average
    from kvports.bench.serving import stop, wait_ready

    out = folder_of(settings, name)
    shutil.rmtree(out, ignore_errors=True)  # lm-eval's files are timestamped: one run's alone in its folder
    out.mkdir(parents=True)
    began = time.perf_counter()
    try:
        wait_ready(process, url)
        ready = time.perf_counter() - began
        print(f"  {name}: ready in {ready:.1f} s; lm-eval running", file=sys.stderr, flush=True)
        before = load_average()
        command = lm_eval_command(url, model, settings.tokenizer, name != PEER_SERVER, settings.concurrent, out)
        if settings.limit is not None:
            command += ["--limit", str(settings.limit)]
        seconds = run_lm_eval(command, out)
        timing = {"seconds": seconds, "start_seconds": ready, "load_average": [before, load_average()]}
    finally:
        stop(process)
    items = read_samples(out)
    right = sum(chosen(item) == item.target for item in items.values())
    print(f"  {name}: {len(items)} items in {seconds:.1f} s, {right} right", file=sys.stderr, flush=True)
    return items, timing


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="tools/eval_ports.py")
    parser.add_argument("--frameworks", default="numpy,torch,jax", help="kvports' ports, comma-separated")
    parser.add_argument("--threads", type=int, default=2, help="each server's threads (default 2)")
    parser.add_argument("--concurrent", type=int, default=1, help="lm-eval's num_concurrent (default 1)")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "eval", help="lm-eval's outputs")
    parser.add_argument("--json", type=Path, help="write the comparison and every item's figures here")
    parser.add_argument("--limit", type=int, help="lm-eval's --limit: the first N items only (a quick try)")
    parser.add_argument("--no-peer", action="store_true", help="leave llama.cpp out")
    parser.add_argument(
        "--peer-server", action="store_true", help="also llama-cpp-python's own server through lm-eval (shifted)"
    )
    parser.add_argument(
        "--table", type=Path, nargs="?", const=RESULTS, help="print the table of a --json file, run nothing"
    )
    return parser.parse_args(argv)


def f32_gguf(weights: Path) -> Path:
    """The F32 GGUF file of the weights the ports run (dequantized from `weights`), as kvports bench
    --peers writes it: kept under $KVPORTS_HOME/gguf, written once."""
    from kvports.formats.gguf.writer import cached_gguf
    from kvports.loading import header, open_model, read_tensors

    file = open_model(weights)
    return cached_gguf(weights, header(file, "float32"), read_tensors(file, "float32"), "f32")


def run_peers(settings: argparse.Namespace, weights: Path, bench: ServingBench, runs: dict, timings: dict) -> None:
    """llama.cpp beside the ports where llama-cpp-python is installed: its library on the reference
    run's token ids, and with --peer-server its own server through lm-eval (shifted: see PEER_SERVER)."""
    from kvports.bench.measure import load_average
    from kvports.bench.serving import free_port, start_peer

    if settings.no_peer:
        return
    if importlib.util.find_spec("llama_cpp") is None:
        print(f"  {PEER}: llama-cpp-python is not installed (pip install 'kvports[peers]'), left out", file=sys.stderr)
        return
    reference = REFERENCE if REFERENCE in runs else next(iter(runs))
    folder = folder_of(settings, reference)
    for name, file, f32_cache in ((PEER, weights, False), (PEER_F32, f32_gguf(weights), True)):
        before, start = load_average(), time.perf_counter()
        runs[name] = llama_cpp_items(file, settings.tokenizer, folder, runs[reference], settings.threads, f32_cache)
        seconds = time.perf_counter() - start
        timings[name] = {"seconds": seconds, "start_seconds": None, "load_average": [before, load_average()]}
        print(f"  {name}: {len(runs[name])} items in {seconds:.1f} s", file=sys.stderr, flush=True)
    if settings.peer_server:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        runs[PEER_SERVER], timings[PEER_SERVER] = evaluate_server(
            PEER_SERVER, start_peer(bench, port), url, "peer", settings
        )


def main(argv: list[str] | None = None) -> int:
    from kvports.bench.serving import ServingBench, free_port, start_kvports
    from kvports.hub import model_path
    from kvports.shared.files import write_atomic

    settings = parse(argv)
    if settings.table is not None:
        document = json.loads(settings.table.read_text())
        print(markdown(document["report"], document["timings"]))
        return 0
    weights = model_path("smollm2")
    if not weights.exists():
        print("error: SmolLM2 is not fetched: run `kvports fetch smollm2` (make model)", file=sys.stderr)
        return 2
    if not Path(sys.executable).with_name("lm_eval").exists():
        print("error: lm-eval is not installed beside this Python: pip install -e '.[eval]'", file=sys.stderr)
        return 2
    frameworks = tuple(settings.frameworks.split(","))
    settings.out.mkdir(parents=True, exist_ok=True)
    settings.tokenizer = settings.out / "tokenizer"
    kvports = str(Path(sys.executable).with_name("kvports"))
    subprocess.run(
        [kvports, "convert", "--from-gguf", str(weights), "--tokenizer-out", str(settings.tokenizer), "--force"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    bench = ServingBench(frameworks, weights, "float32", settings.threads, False, False, None)
    runs, timings = {}, {}
    for framework in frameworks:
        port = free_port()
        name = f"kvports {framework}"
        url = f"http://127.0.0.1:{port}"
        runs[name], timings[name] = evaluate_server(
            name, start_kvports(framework, bench, port), url, weights.stem, settings
        )
    run_peers(settings, weights, bench, runs, timings)
    reference = REFERENCE if REFERENCE in runs else next(iter(runs))
    report = compare(runs, reference)
    print(markdown(report, timings))
    if settings.json is not None:
        settings.json.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "task": TASK,
            "weights": weights.name,
            "dtype": "float32",
            "threads": settings.threads,
            "num_concurrent": settings.concurrent,
            "lm_eval": _version("lm_eval"),
            "cpu_count": os.cpu_count(),
            "report": report,
            "timings": timings,
            "items": per_item(runs),
        }
        write_atomic(settings.json, (json.dumps(document, indent=1) + "\n").encode())
    return 0 if report["ports_agree_on"] == report["items"] else 1


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
