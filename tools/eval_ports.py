"""`make eval`: lm-eval's own `local-completions` model, run against `kvports serve` for each port
on SmolLM2-135M-Instruct at float32, on the project's own multiple-choice task (tools/eval/: 42
questions, 4 choices each), and against llama-cpp-python's server on the same GGUF file where
llama_cpp is installed. Then the per-item comparison lm-eval's table does not give: does every
port choose the same answer for every item, and how far apart are the log-likelihoods it chose by.

Each server is started alone (loopback, a free port, the threads given), waited for, measured
(lm-eval's wall time, the load average from before to after), and stopped before the next. lm-eval
runs as a subprocess of this Python (the `eval` extra: pip install -e '.[eval]'), offline
(HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1: the task is a local JSONL file, the tokenizer is the GGUF
file's own, written by `kvports convert --from-gguf --tokenizer-out`), with --log_samples: each
item's per-choice log-likelihoods are read back from its samples file. kvports' servers get the
prompts as token ids (tokenized_requests=True); llama-cpp-python's server takes text only, so it
gets the same tokens decoded (the GGUF file adds no BOS, so its positions line up).

    python tools/eval_ports.py [--frameworks numpy,torch,jax] [--threads 2] [--concurrent 1]
        [--out build/eval] [--json docs/data/eval_smollm2.json] [--limit N]

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
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK = "kvports_mc"
TASK_DIR = ROOT / "tools" / "eval"
REFERENCE = "kvports torch"  # the reference port: every other server is compared with it
PEER = "llama.cpp server"
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


def max_delta(first: dict[int, Item], second: dict[int, Item]) -> float:
    """The largest |difference| of one choice's log-likelihood between two servers, over every item."""
    return max(
        abs(a - b) for doc in first for a, b in zip(first[doc].loglikelihoods, second[doc].loglikelihoods, strict=True)
    )


def compare(runs: dict[str, dict[int, Item]], reference: str = REFERENCE) -> dict:
    """Per server: accuracy, acc_norm, the items where it chose as the reference did and the largest
    log-likelihood distance from it; across kvports' ports: the items where every port chose alike,
    and the largest distance between any two ports."""
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
    ports = [name for name in runs if name != PEER]
    agreed = [doc for doc in docs if len({chosen(runs[name][doc]) for name in ports}) == 1]
    pairs = {f"{a} / {b}": max_delta(runs[a], runs[b]) for a, b in combinations(ports, 2)}
    return {
        "reference": reference,
        "items": len(docs),
        "servers": servers,
        "ports": ports,
        "ports_agree_on": len(agreed),
        "ports_disagree_on": [doc for doc in docs if doc not in agreed],
        "max_abs_delta_between_ports": max(pairs.values(), default=0.0),
        "pairs": pairs,
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


def markdown(report: dict, timings: dict[str, dict]) -> str:
    """The table docs/SERVING.md pastes: a row per server."""
    total = report["items"]
    lines = [
        f"| server | accuracy | acc_norm | same choice as {report['reference']} | max \\|Δ log-likelihood\\| "
        "| lm-eval s | start s | load before, after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in report["servers"].items():
        timing = timings.get(name, {})
        load = timing.get("load_average", [None, None])
        lines.append(
            f"| {name} | {row['accuracy']:.3f} | {row['acc_norm']:.3f} | {row['same_choice_as_reference']}/{total} "
            f"| {row['max_abs_delta_vs_reference']:.2e} | {timing.get('seconds', float('nan')):.1f} "
            f"| {timing.get('start_seconds', float('nan')):.1f} | {load[0]}, {load[1]} |"
        )
    verdict = "the same answer" if report["ports_agree_on"] == total else "different answers"
    lines.append("")
    lines.append(
        f"kvports' ports ({', '.join(report['ports'])}) chose {verdict} on {report['ports_agree_on']}/{total} "
        f"items; the largest |Δ log-likelihood| between two ports: {report['max_abs_delta_between_ports']:.2e}."
    )
    return "\n".join(lines)


# ---------------------------------------------------------------- running


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


def evaluate_server(name: str, start: object, url: str, model: str, settings: argparse.Namespace) -> tuple:
    """Start a server (`start` has been called: its process), wait for it, run lm-eval, stop it."""
    from kvports.bench.measure import load_average
    from kvports.bench.serving import stop, wait_ready

    process = start
    out = settings.out / name.replace(" ", "-").replace(".", "")
    shutil.rmtree(out, ignore_errors=True)  # lm-eval's files are timestamped: one run's alone in its folder
    out.mkdir(parents=True)
    began = time.perf_counter()
    try:
        wait_ready(process, url)  # type: ignore[arg-type]
        ready = time.perf_counter() - began
        print(f"  {name}: ready in {ready:.1f} s; lm-eval running", file=sys.stderr, flush=True)
        before = load_average()
        command = lm_eval_command(url, model, settings.tokenizer, name != PEER, settings.concurrent, out)
        if settings.limit is not None:
            command += ["--limit", str(settings.limit)]
        seconds = run_lm_eval(command, out)
        timing = {"seconds": seconds, "start_seconds": ready, "load_average": [before, load_average()]}
    finally:
        stop(process)  # type: ignore[arg-type]
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
    parser.add_argument("--no-peer", action="store_true", help="leave llama-cpp-python's server out")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from kvports.bench.serving import ServingBench, free_port, start_kvports, start_peer
    from kvports.hub import model_path
    from kvports.shared.files import write_atomic

    settings = parse(argv)
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
    if settings.no_peer:
        pass
    elif importlib.util.find_spec("llama_cpp") is None:
        print(f"  {PEER}: not installed (pip install 'kvports[peers]'), left out", file=sys.stderr)
    else:
        port = free_port()
        runs[PEER], timings[PEER] = evaluate_server(
            PEER, start_peer(bench, port), f"http://127.0.0.1:{port}", "peer", settings
        )
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
