"""`kvports bench --threads 1,2` and `--rounds R`: each (round, thread count, group) runs in a process of
its own, a group being one framework's rows or the peers' (`runners.group_of`): every framework starts
with that count (JAX sizes its pool once, when it starts) and runs alone, as it does for a user (a
framework measured in a process after another's rows ran slower there). The order is round 1 at each
count, each group in turn, then round 2, ...: the machine's load falls on every row and count alike.
Their JSON is merged into one result: a row per thread count, its figures the medians over every
round's repeats, its tokens compared with the reference row's across the processes, each process's
load and bandwidth kept, and the roofline taken at the best bandwidth any round measured on the row's
device."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

import numpy as np

from kvports.bench.measure import load_average, summarize
from kvports.bench.rows import add_comparisons, add_rooflines
from kvports.bench.runners import FRAMEWORKS, PEERS
from kvports.shared.errors import UserError
from kvports.shared.files import terminated_as_exit

CHILD = "import sys; from kvports import cli; sys.exit(cli.main(sys.argv[1:]))"
NOT_PASSED = {"model", "threads", "rounds", "json", "csv", "plot", "targets", "run", "command", "group"}


def groups(args: argparse.Namespace) -> list[str]:
    """The processes one round at one thread count runs: each framework asked for, then the peers."""
    from kvports.bench.options import parse_choices

    return [*parse_choices(args.frameworks, FRAMEWORKS, "frameworks"), *([PEERS] if args.peers else [])]


def child_argv(args: argparse.Namespace, threads: int | None, group: str | None = None) -> list[str]:
    """`kvports bench` flags that reproduce `args` for one thread count, one round and one group, as JSON on
    stdout: every flag not at its default (the parser's own actions name them), --model already read as
    --weights."""
    from kvports.bench.options import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["bench", "--json", "--rounds", "1"] + ([] if threads is None else ["--threads", str(threads)])
    argv += [] if group is None else ["--group", group]
    for action in parser._actions:
        if not action.option_strings or action.dest in NOT_PASSED or action.dest not in vars(args):
            continue
        value = getattr(args, action.dest)
        if action.nargs == 0:  # store_true
            argv += [action.option_strings[0]] * bool(value)
        elif value is not None and value != action.default:
            text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
            argv += [action.option_strings[0], text]
    return argv


def run_child(argv: list[str]) -> dict[str, Any]:
    # SIGTERM made an exception, so that subprocess.run kills the child as it does on Ctrl-C: a
    # terminated bench left its child running, minutes of both cores.
    with terminated_as_exit():
        done = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True)
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines() or [f"exit status {done.returncode}"]
        error = next((line for line in lines if line.startswith("error: ")), None)
        if error is not None:  # a user error: the same one line the single run gives
            raise UserError(error.removeprefix("error: "))
        raise RuntimeError("a bench run failed:\n" + "\n".join(lines[-20:]))
    return json.loads(done.stdout)


def row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["framework"], row["variant"], row["mode"], row["weights"], row.get("tensor_parallel", 1))


def merge_rows(rounds: list[list[dict[str, Any]]], settings: dict[str, Any]) -> list[dict[str, Any]]:
    """One thread count's rows from every round: the first round's, with every round's repeats and
    their medians (a row unavailable in any round stays as that round gave it)."""
    merged = []
    for row in rounds[0]:
        same = [next(r for r in rows if row_key(r) == row_key(row)) for rows in rounds]
        if not all(r["available"] for r in same):
            merged.append(next(r for r in same if not r["available"]))
            continue
        repeats = [{**repeat, "round": index + 1} for index, r in enumerate(same) for repeat in r["repeats"]]
        pp_tokens = row.get("pp_tokens") or 0
        merged.append(
            {**row, **summarize(repeats, settings["batch"], settings["new_tokens"], pp_tokens), "repeats": repeats}
        )
    return merged


def merge(
    runs: list[tuple[int | None, int, dict[str, Any]]], load_before: float | None, seconds: float
) -> dict[str, Any]:
    """runs: (threads, round, result) in the order they ran -> one result, rows grouped by thread count."""
    first = runs[0][2]
    counts = list(dict.fromkeys(threads for threads, _, _ in runs))
    settings = {
        **first["settings"],
        "threads": {
            "--threads": ",".join(map(str, counts)),
            **{k: v for k, v in first["settings"]["threads"].items() if k in ("cpu_count", "usable_cpus")},
        },
        "threads_by_count": {str(n): result["settings"]["threads"] for n, round_, result in runs if round_ == 1},
        "thread_counts": counts,
        "rounds": max(round_ for _, round_, _ in runs),
    }
    rows = []
    for n in counts:
        rounds = [[{**row, "threads": n} for row in result["rows"]] for threads, _, result in runs if threads == n]
        rows.extend(merge_rows(rounds, settings))
    best: dict[str, float] = {}  # device -> bytes/s: the best any round streamed
    for _, _, result in runs:
        for device, value in (result["machine"].get("roofline_bandwidth_gb_s") or {}).items():
            best[device] = max(best.get(device, 0.0), value * 1e9)
    format_bytes = first["machine"].get("decode_bytes_per_step_by_format") or {}
    add_rooflines(rows, best, {device: device for device in best}, format_bytes)
    machine = {
        **first["machine"],
        "roofline_bandwidth_gb_s": {device: value / 1e9 for device, value in best.items()} or None,
        "bench_seconds": seconds,
        "load_average": [load_before, load_average()],
        "runs": [
            {
                "threads": n,
                "round": round_,
                "load_average": result["machine"]["load_average"],
                "bench_seconds": result["machine"]["bench_seconds"],
                "bandwidth_gb_s": result["machine"]["bandwidth_gb_s"],
            }
            for n, round_, result in runs
        ],
    }
    return {"settings": settings, "machine": machine, "rows": rows}


def combined(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One round at one thread count, from its groups' processes: their rows in turn, the first's settings
    (every library's versions), the bandwidths each probed, its load from the first's start to the last's end."""
    first, last = results[0], results[-1]
    bandwidth: dict[str, float] = {}
    roofline: dict[str, float] = {}
    versions: dict[str, str] = {}
    for result in results:
        bandwidth.update(result["machine"].get("bandwidth_gb_s") or {})
        versions.update(result["settings"].get("versions") or {})
        for device, value in (result["machine"].get("roofline_bandwidth_gb_s") or {}).items():
            roofline[device] = max(roofline.get(device, 0.0), value)
    machine = {
        **first["machine"],
        "bandwidth_gb_s": bandwidth or None,
        "roofline_bandwidth_gb_s": roofline or None,
        "load_average": [first["machine"]["load_average"][0], last["machine"]["load_average"][-1]],
        "bench_seconds": sum(result["machine"]["bench_seconds"] for result in results),
    }
    rows = [row for result in results for row in result["rows"]]
    return {"settings": {**first["settings"], "versions": versions}, "machine": machine, "rows": rows}


def compare_tokens(result: dict[str, Any]) -> None:
    """Each thread count's rows held to its reference row's tokens (`rows.add_comparisons`), now that the rows
    of every group's process are side by side; the tokens are dropped then, as a single run drops them."""
    prompt_len = result["settings"]["prompt_len"]
    for n in result["settings"]["thread_counts"]:
        rows = [row for row in result["rows"] if row["threads"] == n]
        for row in rows:
            if "tokens" in row:
                row["tokens"] = np.asarray(row["tokens"])  # [B, P + N]
        add_comparisons(rows, prompt_len)


def run_interleaved(args: argparse.Namespace, counts: list[int | None]) -> dict[str, Any]:
    """Every round at every thread count, each group in its own process, merged (targets and plots: the caller's)."""
    start, load_before = time.perf_counter(), load_average()
    runs = []
    for round_ in range(1, args.rounds + 1):
        for threads in counts:
            results = []
            for group in groups(args):
                if sys.stderr.isatty():  # where a person watches: which run is under way (never before an error line)
                    print(
                        f"round {round_}/{args.rounds}, threads {threads or 'default'}, {group} ...",
                        file=sys.stderr,
                        flush=True,
                    )
                results.append(run_child(child_argv(args, threads, group)))
            runs.append((threads, round_, combined(results)))
    result = merge(runs, load_before, time.perf_counter() - start)
    compare_tokens(result)
    return result
