"""The bench's PNGs, read at a glance: per-step latency against position, one panel per port
on one shared log y-axis (so a flat cached curve is not squashed under naive's growing one),
the roofline drawn where it was measured; total time against new tokens, log-log. One colour
per framework and one line style per mode in every figure; legends sit outside the data.
matplotlib is imported only when a plot is asked for."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

from kvports.shared.files import write_atomic

# Okabe-Ito's colour-blind-safe palette: the same colour for a framework in every figure.
FRAMEWORK_COLORS = {
    "torch": "#D55E00",
    "jax": "#0072B2",
    "numpy": "#009E73",
    "seed-concat": "#E69F00",
    "transformers": "#CC79A7",
    "torch.compile": "#56B4E9",
}
MODE_STYLES = {"naive": "--", "cached": "-", "speculative": ":"}
PANELS = ("torch", "jax", "numpy")
BASELINES = ("seed-concat", "transformers")  # PyTorch underneath: they share the torch panel


def row_name(row: dict[str, Any]) -> str:
    return row["framework"] if row["variant"] is None else row["variant"]


FORMAT_MARKERS = ("", "o", "s", "^", "v", "D", "x", "+")  # a port's first weight format unmarked, the others marked


def line_label(row: dict[str, Any], s: dict[str, Any]) -> str:
    """The framework and mode, and a port's weight format when the run has several."""
    several = len(s.get("formats") or ()) > 1 and row["variant"] is None and row.get("weights") is not None
    return f"{row_name(row)} {row['mode']}" + f" {row['weights']}" * several


def format_marker(row: dict[str, Any], s: dict[str, Any]) -> str:
    formats = list(s.get("formats") or ())
    index = formats.index(row["weights"]) if row.get("weights") in formats and row["variant"] is None else 0
    return FORMAT_MARKERS[index % len(FORMAT_MARKERS)]


def write_plots(result: dict[str, Any], folder: Path) -> list[Path]:
    """The figures the rows so far allow (called again as more rows arrive): the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in result["rows"] if row["available"]]
    written = []
    stepped = [row for row in rows if row["per_step_ms"] and row["mode"] != "speculative"]
    if stepped:
        figure = per_step_figure(plt, result["settings"], stepped)
        written.append(save_figure(figure, folder / f"per_step_{result['settings']['preset']}.png"))
        plt.close(figure)
    swept = [row for row in rows if row.get("sweep")]
    if swept:
        figure = total_figure(plt, result["settings"], swept)
        written.append(save_figure(figure, folder / f"total_vs_tokens_{result['settings']['preset']}.png"))
        plt.close(figure)
    return written


def per_step_figure(plt: Any, s: dict[str, Any], rows: list[dict[str, Any]]) -> Any:
    """Per-step latency against position, one panel per port, one shared log y-axis."""
    import matplotlib.ticker

    panels = [name for name in PANELS if any(row["framework"] == name for row in rows)] or ["torch"]
    figure, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), squeeze=False, sharey=True)
    positions = s["prompt_len"] + np.arange(1, s["new_tokens"])  # context length at decode steps 1..N-1
    handles: dict[str, Any] = {}
    for axis, name in zip(axes[0], panels, strict=True):
        shown = [row for row in rows if row["framework"] == name]
        if name == "torch":
            shown += [row for row in rows if row["framework"] in BASELINES]
        for row in shown:
            steps = np.asarray(row["per_step_ms"][1:])  # [N - 1]; step 0 (the prefill) is in the table
            (line,) = axis.plot(
                positions,
                steps,
                MODE_STYLES.get(row["mode"], "-"),
                color=FRAMEWORK_COLORS.get(row_name(row), "gray"),
                linewidth=1.2,
                marker=format_marker(row, s) or None,
                markevery=max(1, len(steps) // 8),
                markersize=3,
            )
            handles.setdefault(line_label(row, s), line)
        roofline = [row["roofline_ms"] for row in shown if row.get("roofline_ms")]
        if roofline:
            line = axis.axhline(min(roofline), color="black", linestyle="-.", linewidth=0.9)
            handles.setdefault("roofline (bytes per step / bandwidth)", line)
        axis.set_title(name if name != "torch" else "torch (and the PyTorch baselines)", fontsize=10)
        axis.set_xlabel("position (tokens in context)")
        axis.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        axis.set_yscale("log")
        axis.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("ms per decode step (log)")
    figure.suptitle(
        f"per-step decode latency, {s['preset']}, batch {s['batch']}, prompt {s['prompt_len']}, "
        f"{s['device']} (median of {s['repeats']}), {', '.join(s.get('formats') or [s['dtype']])}\ncolour: framework, "
        "dashed: naive, solid: cached" + ", marker: weight format" * (len(s.get("formats") or ()) > 1),
        fontsize=9,
    )
    legend_below(figure, handles, columns=4)
    return figure


def total_figure(plt: Any, s: dict[str, Any], rows: list[dict[str, Any]]) -> Any:
    """Total time against new tokens, log-log: slope ~1 for a flat per-step cost, towards 2 for a growing one."""
    import matplotlib.ticker

    figure, axis = plt.subplots(figsize=(7.5, 6))
    handles = {}
    for row in rows:
        sweep = row["sweep"]
        (line,) = axis.loglog(
            sweep["new_tokens"],
            sweep["total_s"],
            MODE_STYLES.get(row["mode"], "-"),
            marker="o" if row["mode"] == "naive" else "s",
            markersize=3,
            linewidth=1.2,
            color=FRAMEWORK_COLORS.get(row_name(row), "gray"),
        )
        slope = "" if sweep["slope"] is None else f" (slope {sweep['slope']:.2f})"
        handles[line_label(row, s) + slope] = line
    axis.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axis.set_xticks(rows[0]["sweep"]["new_tokens"])
    axis.set_xlabel("new tokens")
    axis.set_ylabel("total seconds")
    axis.grid(alpha=0.3, which="both")
    axis.set_title(
        f"total time against new tokens, {s['preset']}, prompt {s['prompt_len']}, {s['device']} "
        f"(median of {s['repeats']})\nslope: fitted log-log exponent; colour: framework, dashed: naive, solid: cached",
        fontsize=9,
    )
    legend_below(figure, handles, columns=2)
    return figure


def legend_below(figure: Any, handles: dict[str, Any], columns: int) -> None:
    """One legend under the panels, never over a curve: room is made for its rows."""
    columns = min(columns, max(1, len(handles)))
    rows_needed = -(-len(handles) // columns)
    figure.legend(list(handles.values()), list(handles), loc="lower center", ncol=columns, fontsize=8, frameon=False)
    height = figure.get_figheight()
    figure.tight_layout(rect=(0, (0.2 + 0.17 * rows_needed) / height, 1, 1))


def save_figure(figure: Any, path: Path) -> Path:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    write_atomic(path, buffer.getvalue())
    return path
