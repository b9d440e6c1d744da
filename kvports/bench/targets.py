"""The speed targets the bench was built to show, each checked at the settings it was set
for and reported as met or missed: measured, never asserted."""

from __future__ import annotations

from typing import Any

from kvports.bench.measure import format_of

PEERS = ("llama.cpp", "ctranslate2")
# The peer each weight format is held to: the engine people would run instead, at the same bytes.
HELD_TO = {"float32": ("llama.cpp", "F32"), "bfloat16": ("llama.cpp", "F16")}
# The rows a port is judged by: its own, and torch's compiled row.
COUNTED_VARIANTS = (None, "torch.compile")
QUANT_HELD_TO = {"int8": ("ctranslate2", "int8"), "q4": ("llama.cpp", "Q4_1")}
# (what, the formats' rows, peer, the ratio's figure, thresholds, higher is better) per thread count; the
# thresholds (at one thread or the frameworks' default, at two threads or more) differ for float32's tg:
# given a second core, a port's time per token within 1.15x of llama.cpp F32's (issue 46).
PEER_TARGETS = (
    ("tg, x the time per token of", ("float32",), ("torch", "jax", "numpy"), "tg", (1.0, 1.15), False),
    ("tg, x the time per token of", ("bfloat16",), ("torch", "jax"), "tg", (1.15, 1.15), False),
    ("(the best int8 row) tg, x the time per token of", ("+int8",), None, "tg", (1.0, 1.0), False),
    ("(the best 4-bit row) tg, x the time per token of", ("+q4",), None, "tg", (1.0, 1.0), False),
    ("pp, x the prompt tokens/s of", ("float32",), ("torch", "jax", "numpy"), "pp", (0.8, 0.8), True),
)


def threshold_at(thresholds: tuple[float, float], threads: int | None) -> float:
    """A target's threshold at a thread count: the first at one thread or the default (None), else the second."""
    return thresholds[1] if threads is not None and threads > 1 else thresholds[0]


def held_to(row: dict[str, Any]) -> tuple[str, str] | None:
    """(peer framework, its weights) a row is held to: float32 to llama.cpp F32, bfloat16 to F16, int8 to
    CTranslate2 int8, 4 bits to llama.cpp Q4_1; None for a peer's own row and float64."""
    if row["framework"] in PEERS or row["weights"] is None:
        return None
    dtype, quant = format_of(row["weights"])
    return QUANT_HELD_TO.get(quant) or HELD_TO.get(dtype)


def add_peer_ratios(rows: list[dict[str, Any]]) -> None:
    """Each live row's `held_to` peer (at the same thread count, cached, one device) and its ratios to it:
    `tg_vs_peer`, the row's time per generated token over the peer's (below 1: faster), and `pp_vs_peer`,
    its prompt tokens/s over the peer's (above 1: faster). None where the peer did not run."""
    peers = {
        (row["framework"], row["weights"], row.get("threads")): row
        for row in rows
        if row["available"] and row["framework"] in PEERS
    }
    for row in rows:
        if not row["available"]:
            continue
        peer = held_to(row)
        found = None if peer is None else peers.get((*peer, row.get("threads")))
        row["held_to"] = None if peer is None else " ".join(peer)
        peer_figures = found or {}
        row["tg_vs_peer"] = ratio(peer_figures.get("tg_tokens_per_s"), row["tg_tokens_per_s"])
        row["pp_vs_peer"] = ratio(row["pp_tokens_per_s"], peer_figures.get("pp_tokens_per_s"))


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if not numerator or not denominator else numerator / denominator


def peer_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets against the peers, at each thread count: every port's float32 tg at or below llama.cpp
    F32's time per token (within 1.15x at two threads or more), torch's and JAX's bfloat16 within 1.15x
    of F16, the best int8 row at or below CTranslate2 int8, the best 4-bit row at or below Q4_1, every
    port's float32 pp at least 0.8x F32's.
    A port is judged by its best row of a format: torch's compiled row (`--compile`) is torch, run as
    its experts would; the target's name says which row it was."""
    live = [
        row
        for row in rows
        if row["available"]
        and row["mode"] == "cached"
        and row["variant"] in COUNTED_VARIANTS
        and row.get("tensor_parallel", 1) == 1
        and row.get("held_to")
    ]
    found = []
    for threads in dict.fromkeys(row.get("threads") for row in live):
        at = [row for row in live if row.get("threads") == threads]
        for what, formats, ports, figure, thresholds, higher in PEER_TARGETS:
            key = f"{figure}_vs_peer"
            threshold = threshold_at(thresholds, threads)
            chosen = [row for row in at if row["weights"] in formats or row["weights"].endswith(formats)]
            chosen = [row for row in chosen if row[key] is not None and (ports is None or row["framework"] in ports)]
            groups: dict[object, list[dict[str, Any]]] = {}  # the rows one target line judges by their best
            for row in chosen:
                groups.setdefault(None if ports is None else (row["framework"], row["weights"]), []).append(row)
            for group in groups.values():
                row = max(group, key=lambda r: r[key]) if higher else min(group, key=lambda r: r[key])
                value = row[key]
                variant = f" ({row['variant']})" if row["variant"] else ""
                found.append(
                    {
                        "target": f"{row['framework']} {row['weights']}{variant} {what} {row['held_to']}",
                        "threads": threads,
                        "value": value,
                        "threshold": threshold,
                        "met": bool(value >= threshold if higher else value <= threshold),
                    }
                )
    return found


def targets(rows: list[dict[str, Any]], settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The development targets, at the settings they were set for (seed preset, batch 1; 500 new
    tokens for cached against naive; gpt2-small for the roofline; the first weight format asked
    for, float32 by default). Reported, never asserted."""
    live: dict[tuple[str, str | None, str], dict[str, Any]] = {}
    for row in rows:  # a port's first row per mode: at the first format, on one device
        if row["available"]:
            live.setdefault((row["framework"], row["variant"], row["mode"]), row)
    found = peer_targets(rows)

    def get(framework: str, mode: str, key: str) -> Any:
        row = live.get((framework, None, mode))
        return None if row is None else row.get(key)

    def add(name: str, value: float | None, threshold: float, higher_is_better: bool = True) -> None:
        if value is not None:
            met = value >= threshold if higher_is_better else value <= threshold
            found.append({"target": name, "value": value, "threshold": threshold, "met": bool(met)})

    seed_run = settings["preset"] == "seed" and settings["batch"] == 1
    if seed_run:
        # JAX's decode ms is its stepwise loop (one compiled call per step); its compiled loop below
        for framework, threshold in (("torch", 2.0), ("jax", 2.0), ("numpy", 1.5)):
            add(
                f"{framework} cached decode ms/token, x faster than seed-concat",
                get(framework, "cached", "decode_speedup_vs_seed_concat"),
                threshold,
            )
        seed_total, jax_total = get("seed-concat", "cached", "total_s"), get("jax", "cached", "total_s")
        if seed_total is not None and jax_total is not None:  # JAX's steady state is its compiled loop
            add("jax cached compiled loop, total x faster than seed-concat", seed_total / jax_total, 10.0)
    if seed_run and settings["new_tokens"] >= 500:
        for framework in ("torch", "jax", "numpy"):
            add(
                f"{framework} cached total, x faster than naive",
                get(framework, "cached", "total_speedup_vs_naive"),
                10.0,
            )
        for framework in ("torch", "jax", "numpy"):
            naive = (get(framework, "naive", "sweep") or {}).get("slope")
            cached = (get(framework, "cached", "sweep") or {}).get("slope")
            if naive is not None and cached is not None:
                add(f"{framework} log-log slope of total time, naive minus cached", naive - cached, 0.3)
    if settings["preset"] == "gpt2-small" and settings["batch"] == 1:
        ratios = [
            row["roofline_ratio"]
            for row in live.values()
            if row["roofline_ratio"] is not None and row["mode"] == "cached"
        ]
        for framework in ("torch", "jax", "numpy"):
            add(
                f"{framework} cached decode ms/token, x roofline",
                get(framework, "cached", "roofline_ratio"),
                1.5,
                higher_is_better=False,
            )
        if ratios:
            add("best cached decode ms/token, x roofline", min(ratios), 1.25, higher_is_better=False)
        torch_ms, hf_ms = (
            get("torch", "cached", "decode_ms_per_token"),
            get("transformers", "cached", "decode_ms_per_token"),
        )
        if torch_ms is not None and hf_ms is not None:
            add("torch cached decode ms/token, x faster than transformers", hf_ms / torch_ms, 1.1)
    return found
