"""The bench's PNGs: per-step latency against position, one panel per port; total time
against new tokens, log-log. matplotlib is imported only when a plot is asked for."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

from kvports.shared.files import write_atomic


def write_plots(result: dict[str, Any], folder: Path) -> list[Path]:
    """Per-step latency against position, one panel per port; total time against new tokens, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    s = result["settings"]
    rows = [row for row in result["rows"] if row["available"]]
    stem = s["preset"]
    written = []
    colors = {("naive", None): "tab:red", ("cached", None): "tab:blue", ("cached", "torch.compile"): "tab:purple"}
    baseline_colors = {"seed-concat": "tab:orange", "transformers": "tab:green"}
    framework_colors = {
        "torch": "tab:blue",
        "jax": "tab:red",
        "numpy": "tab:green",
        "seed-concat": "tab:orange",
        "transformers": "tab:gray",
        "torch.compile": "tab:purple",
    }

    panels = [name for name in ("torch", "jax", "numpy") if any(row["framework"] == name for row in rows)]
    if panels:
        figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
        for axis, name in zip(axes[0], panels, strict=True):
            shown = [row for row in rows if row["framework"] == name]
            if name == "torch":  # the baselines are PyTorch too: they share its panel
                shown += [row for row in rows if row["framework"] in baseline_colors]
            for row in shown:
                steps = np.asarray(row["per_step_ms"][1:])  # [N - 1]; step 0 (prefill) is in the table
                positions = s["prompt_len"] + np.arange(1, s["new_tokens"])  # context length at each step
                color = baseline_colors.get(row["framework"], colors.get((row["mode"], row["variant"]), "tab:gray"))
                label = (
                    row["mode"]
                    if row["framework"] == name and row["variant"] is None
                    else f"{row['framework'] if row['variant'] is None else row['variant']} {row['mode']}"
                )
                axis.plot(positions, steps, color=color, label=label, linewidth=1)
            axis.set_title(name)
            axis.set_xlabel("position (tokens in context)")
            axis.set_ylabel("ms per step")
            axis.set_ylim(bottom=0)
            axis.grid(alpha=0.3)
            axis.legend(fontsize=8)
        figure.suptitle(
            f"per-step decode latency, {stem}, batch {s['batch']}, prompt {s['prompt_len']}, {s['dtype']}, "
            f"{s['device']} (median of {s['repeats']})",
            fontsize=10,
        )
        figure.tight_layout()
        written.append(save_figure(figure, folder / f"per_step_{stem}.png"))
        plt.close(figure)

    swept = [row for row in rows if row.get("sweep")]
    if swept:
        figure, axis = plt.subplots(figsize=(7, 5))
        for row in swept:
            sweep = row["sweep"]
            name = row["framework"] if row["variant"] is None else row["variant"]
            naive = row["mode"] == "naive"
            axis.loglog(
                sweep["new_tokens"],
                sweep["total_s"],
                "--o" if naive else "-s",
                markersize=3,
                linewidth=1,
                color=framework_colors.get(name, "tab:gray"),
                label=f"{name} {row['mode']} (slope {sweep['slope']:.2f})",
            )
        axis.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.set_xticks(swept[0]["sweep"]["new_tokens"])
        axis.set_xlabel("new tokens")
        axis.set_ylabel("total seconds")
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=7)
        axis.set_title(
            f"total time against new tokens, {stem}, prompt {s['prompt_len']} (median of {s['repeats']})\n"
            "slope: fitted log-log exponent; dashed: naive",
            fontsize=9,
        )
        figure.tight_layout()
        written.append(save_figure(figure, folder / f"total_vs_tokens_{stem}.png"))
        plt.close(figure)
    return written


def save_figure(figure: Any, path: Path) -> Path:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    write_atomic(path, buffer.getvalue())
    return path
