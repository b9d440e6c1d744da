"""The table `kvports bench` prints: one line per row, its notes and the machine's figures below."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvports.bench.measure import MATVEC_SHAPE
from kvports.limits import fmt_bytes
from kvports.terminal import console_for


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def row_name(row: dict) -> str:
    name = row["framework"] if row["variant"] is None else f"{row['framework']} ({row['variant']})"
    return name + (f" tp={row['tensor_parallel']}" if row.get("tensor_parallel", 1) > 1 else "")


def differ_causes(rows: list[dict], dtype: str) -> str:
    """Why each row's tokens differ, by its weight format: at the bench's precision (float32, or an F32
    file) near-ties part frameworks; on weights rounded to fewer bits, the rounding does."""
    full = (dtype, dtype.replace("float", "F"))  # float32 and llama.cpp's F32 name one format
    near = [row for row in rows if row.get("weights") in (*full, None)]
    rounded = [row for row in rows if row not in near]
    causes = []
    if near:
        causes.append(
            f"{', '.join(dict.fromkeys(map(row_name, near)))}: {dtype} near-ties part frameworks (kvports compare "
            "reports the step and margin)"
        )
    if rounded:
        formats = ", ".join(dict.fromkeys(row["weights"] for row in rounded))
        causes.append(
            f"{', '.join(dict.fromkeys(map(row_name, rounded)))}: weights rounded to {formats}, not {dtype}; the "
            "rounding, not a near-tie, changes their tokens"
        )
    return "; ".join(causes)


@dataclass(frozen=True)
class Columns:
    """The table's columns: the fixed ones, and which optional groups the rows call for."""

    names: list[str]
    several_threads: bool
    pp: bool
    held: bool  # rows held to a peer's figures
    peers: bool  # the leading tokens each row shares with the float32 reference
    roofline: bool
    swept: bool
    speculative: bool
    unavailable: bool


def columns_of(settings: dict, rows: list[dict]) -> Columns:
    live = [row for row in rows if row["available"]]
    several_threads = len(settings.get("thread_counts") or ()) > 1
    pp = bool(settings.get("pp"))
    held = any(row.get("tg_vs_peer") is not None for row in live)
    # Beside the peers or other weight formats.
    peers = bool(settings.get("peers")) or len(settings.get("formats") or ()) > 1
    roofline = any(row["roofline_ratio"] is not None for row in live)
    swept = any(row["sweep"] for row in live)
    speculative = any(row["mode"] == "speculative" for row in live)
    names = ["framework", "mode", "weights", "ttft ms", "decode ms", "p90 ms", "tok/s", "total s", "compile s"]
    names += ["KV cache", "vs seed", "vs naive"]
    names[3:3] = ["threads"] * several_threads
    names += ["pp tok/s"] * pp + ["tg tok/s"] * (pp or held) + ["held to", "tg x peer", "pp x peer"] * held
    names += (
        ["agree"] * peers
        + ["roofline"] * roofline
        + ["slope"] * swept
        + ["accepted", "fwd/tok", "vs cached"] * speculative
    )
    unavailable = any(not row["available"] for row in rows)
    return Columns(names, several_threads, pp, held, peers, roofline, swept, speculative, unavailable)


def print_table(result: dict, show_targets: bool = False) -> None:
    """The rows, then what the columns mean, the notes, the machine; the development targets
    only when asked for (--targets: they are the project's, not a user's)."""
    from rich.table import Table

    s, rows = result["settings"], result["rows"]
    live = [row for row in rows if row["available"]]
    title = (
        f"kvports bench: {s['preset']} ({s['parameters'] / 1e6:.1f}M parameters), batch {s['batch']}, "
        f"prompt {s['prompt_len']}, {s['new_tokens']} new tokens, {', '.join(s.get('formats') or [s['dtype']])}, "
        f"{s['device']}; "
        f"median of {s['repeats']} after {s['warmup']} warm-up"
    )
    columns = columns_of(s, rows)
    table = Table(title=title)
    for column in columns.names:
        table.add_column(
            column, justify="left" if column in ("framework", "mode", "weights") else "right", no_wrap=True
        )
    if columns.unavailable:
        table.add_column("reason", justify="left", overflow="fold")  # text: never inside a number column
    notes: list[str] = []
    for row in rows:
        name = row_name(row)
        if not row["available"]:
            weights = row.get("weights") or "-"
            filler = ["-"] * (len(columns.names) - 3)
            table.add_row(name, row["mode"], weights, *filler, f"unavailable: {row['reason']}")
            continue
        if row["note"]:
            if row["note"] not in notes:
                notes.append(row["note"])
            name += f" [{notes.index(row['note']) + 1}]"
        if not row["tokens_agree"]:
            name += " *"
        table.add_row(*row_cells(name, row, s, columns), *[""] * columns.unavailable)
    console = console_for(table)  # the table's width, even when piped
    console.print(table)
    console.print(legend(s, live, columns), highlight=False, markup=False)
    for index, note in enumerate(notes, 1):
        console.print(f"[{index}] {note}", highlight=False, markup=False)
    print_footer(console, result, live, show_targets)


def row_cells(name: str, row: dict, s: dict, columns: Columns) -> list[str]:
    """One available row's cells, in `columns`' order."""
    cells = [
        name,
        row["mode"],
        str(row["weights"] or "-") + (f" via {row['route']}" if row.get("route") else ""),  # a fallback shows
        fmt(row["ttft_ms"], ".2f"),
        fmt(row["decode_ms_per_token"], ".3f"),
        fmt(row["decode_ms_p90"], ".3f"),
        fmt(row["tokens_per_s"], ",.0f"),
        fmt(row["total_s"], ".3f"),
        fmt(row["compile_s"], ".2f"),
        "-" if row["kv_cache_bytes"] is None else fmt_bytes(row["kv_cache_bytes"]),
        fmt(row["decode_speedup_vs_seed_concat"], ".2f", "x"),
        fmt(row["total_speedup_vs_naive"], ".1f", "x"),
    ]
    cells[3:3] = [str(row.get("threads") or "default")] * columns.several_threads
    cells += [fmt(row.get("pp_tokens_per_s"), ",.0f")] * columns.pp
    cells += [fmt(row.get("tg_tokens_per_s"), ",.1f")] * (columns.pp or columns.held)
    if columns.held:
        cells += [
            row.get("held_to") or "-",
            fmt(row.get("tg_vs_peer"), ".2f", "x"),
            fmt(row.get("pp_vs_peer"), ".2f", "x"),
        ]
    cells += [f"{row['agree_steps']}/{s['new_tokens']}"] * columns.peers
    cells += [fmt(row["roofline_ratio"], ".2f", "x") + " !" * bool(row.get("roofline_disturbed"))] * columns.roofline
    cells += [fmt((row["sweep"] or {}).get("slope"), ".2f")] * columns.swept
    if columns.speculative:
        counts = row.get("speculative") or {}
        cells += [
            fmt(counts.get("acceptance_rate"), ".0%"),
            fmt(counts.get("target_forwards_per_token"), ".2f"),
            fmt(row["speedup_vs_cached"], ".2f", "x"),
        ]
    return cells


def legend(s: dict, live: list[dict], columns: Columns) -> str:
    """What the columns mean, those shown only."""
    return (
        "ttft: time to first token (prefill); decode: median ms per decode step, p90 its 90th percentile; "
        "tok/s: batch x new tokens / total s; vs seed: seed-concat's decode ms over this row's; vs naive: "
        "the same port's naive total over this row's"
        + (
            f"; agree: the leading new tokens equal to {live[0]['agree_reference']}'s (a quantized engine is not "
            "expected to match)"
        )
        * (columns.peers and bool(live))
        + (f"; pp: prompt tokens/s of a {s.get('pp')}-token prefill; tg: generated tokens/s over decode steps 1..N-1")
        * columns.pp
        + (
            "; held to: the peer the row's weight format is held to; tg x peer: the row's time per generated token "
            "over the peer's (below 1: faster); pp x peer: its prompt tokens/s over the peer's (above 1: faster)"
        )
        * columns.held
        + "; roofline: decode ms over the roofline's (the bytes a step streams in the row's format)" * columns.roofline
        + "; slope: fitted log-log exponent of total time against new tokens" * columns.swept
        + (
            "; accepted: the draft's proposals the target kept; fwd/tok: target forwards per generated token; "
            "vs cached: the same port's cached total over this row's"
        )
        * columns.speculative
    )


def print_footer(console: Any, result: dict, live: list[dict], show_targets: bool) -> None:
    """Below the table: the disturbed rooflines, the rows whose tokens differ, the machine, the targets."""
    s = result["settings"]
    if any(row.get("roofline_disturbed") for row in live):
        from kvports.bench.rows import DISTURBED

        console.print(f"! roofline {DISTURBED}", highlight=False, markup=False)
    differ = [row for row in live if not row["tokens_agree"]]
    if differ:
        console.print(
            f"* tokens differ from {live[0]['tokens_reference']}'s: " + differ_causes(differ, s["dtype"]),
            highlight=False,
            markup=False,
        )
    machine = result["machine"]
    if machine["bandwidth_gb_s"]:
        measured = ", ".join(f"{name} {value:.1f}" for name, value in machine["bandwidth_gb_s"].items())
        by_dtype = (
            machine.get("decode_bytes_per_step_by_format")
            or machine.get("decode_bytes_per_step_by_dtype")
            or {s["dtype"]: machine["decode_bytes_per_step"]}
        )
        read = ", ".join(f"{value / 1e6:.1f} MB at {name}" for name, value in by_dtype.items())
        console.print(
            f"streaming bandwidth, GB/s, float32 {MATVEC_SHAPE[0]}x{MATVEC_SHAPE[1]} matrix-vector product: "
            f"{measured}. Roofline: {read} read per decode step (weights in the row's format + KV cache so far) "
            "over the best bandwidth on the row's device.",
            highlight=False,
            markup=False,
        )
    threads = ", ".join(f"{name} {value}" for name, value in s["threads"].items())
    console.print(
        f"threads: {threads}; load average before / after: {machine['load_average'][0]} / {machine['load_average'][1]}",
        highlight=False,
        markup=False,
    )
    if machine.get("runs"):
        each = "; ".join(
            f"round {run['round']} at {run['threads'] or 'default'} thread(s) {run['load_average'][0]} / "
            f"{run['load_average'][1]}"
            for run in machine["runs"]
        )
        console.print(f"each run's load average before / after: {each}", highlight=False, markup=False)
    for target in result["targets"] if show_targets else []:
        verdict = "met" if target["met"] else "MISSED"
        at = "" if target.get("threads") is None else f", {target['threads']} thread(s)"
        console.print(
            f"target: {target['target']}{at}: {target['value']:.2f} (target {target['threshold']}): {verdict}",
            highlight=False,
            markup=False,
        )
