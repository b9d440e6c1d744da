"""The speed targets the bench was built to show, each checked at the settings it was set
for and reported as met or missed: measured, never asserted."""

from __future__ import annotations

from typing import Any


def targets(rows: list[dict[str, Any]], settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The development targets, at the settings they were set for (seed preset, batch 1; 500 new
    tokens for cached against naive; gpt2-small for the roofline; the first weight format asked
    for, float32 by default). Reported, never asserted."""
    live: dict[tuple[str, str | None, str], dict[str, Any]] = {}
    for row in rows:  # a port's first row per mode: at the first format, on one device
        if row["available"]:
            live.setdefault((row["framework"], row["variant"], row["mode"]), row)
    found = []

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
