"""docs/BENCH.md's table and figure of kvports beside llama.cpp and CTranslate2, from the JSON of
`kvports bench --peers --json` runs (one per thread count): one line per engine and weight
format, decode ms per token and prefill at each thread count, and the leading tokens that agree
with the float32 reference. A run given several formats (`--dtype float32,bfloat16 --quant
none,int8,q4`) has a row per port and format, each named by its `weights` field (`float32`,
`bfloat16+int8`, ...): each is a line of its own.

    python tools/peers_report.py docs/data/peers_smollm2_t1.json docs/data/peers_smollm2_t2.json \\
        --plot docs/img/peers_smollm2.png
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, kvports importable or not

# The committed runs, one per thread count (those that exist: a run at another count adds columns).
RUNS = sorted((ROOT / "docs" / "data").glob("peers_smollm2_t*.json"))
FIGURE = ROOT / "docs" / "img" / "peers_smollm2.png"


def read_runs(paths: list[Path]) -> list[dict[str, Any]]:
    return [json.loads(Path(path).read_text()) for path in paths]


def threads(result: dict[str, Any]) -> int:
    """The thread count every row of the run was given (the peers' count is the ports')."""
    return int(result["settings"]["threads"]["peers"])


def engine(row: dict[str, Any]) -> str:
    """The framework, with its variant where the weights column does not already say it (torch.compile),
    and a split model's device count (a line apart from the one-device row at the same format)."""
    plain = row["variant"] is None or row["variant"] == row["weights"]
    name = row["framework"] if plain else f"{row['framework']} ({row['variant']})"
    return name + (f" tp={row['tensor_parallel']}" if row.get("tensor_parallel", 1) > 1 else "")


def lines(results: list[dict[str, Any]]) -> list[tuple[str, str, dict[int, dict[str, Any]]]]:
    """(engine, weights, thread count -> row) for every available cached row, in the runs' order."""
    table: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for result in results:
        for row in result["rows"]:
            if row["available"] and row["mode"] == "cached":
                table.setdefault((engine(row), str(row["weights"])), {})[threads(result)] = row
    return [(name, weights, by_threads) for (name, weights), by_threads in table.items()]


def figure(value: float | None, spec: str) -> str:
    return "-" if value is None else f"{value:{spec}}"


def markdown(results: list[dict[str, Any]]) -> str:
    counts = sorted({threads(result) for result in results})
    new_tokens = results[0]["settings"]["new_tokens"]
    reference = next(row["agree_reference"] for row in results[0]["rows"] if row["available"])
    per_thread = [f"{n} thread{'s' * (n > 1)}" for n in counts]
    header = (
        ["engine", "weights"]
        + [f"decode ms/token, {t}" for t in per_thread]
        + [f"x llama.cpp F32, {t}" for t in per_thread]
        + [f"prefill ms, {t}" for t in per_thread]
        + [f"agree with {reference}, {t}" for t in per_thread]
    )
    out = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
    table = lines(results)
    # The float32 floor each row is held to: llama.cpp on the F32 file written from the same weights.
    floor = next((by_threads for name, weights, by_threads in table if (name, weights) == ("llama.cpp", "F32")), {})
    for name, weights, by_threads in table:
        decode = {n: by_threads.get(n, {}).get("decode_ms_per_token") for n in counts}
        cells = [name, weights]
        cells += [figure(decode[n], ".1f") for n in counts]
        cells += [
            "-" if decode[n] is None or n not in floor else f"{decode[n] / floor[n]['decode_ms_per_token']:.2f}x"
            for n in counts
        ]
        cells += [figure(by_threads.get(n, {}).get("ttft_ms"), ".0f") for n in counts]
        cells += ["-" if n not in by_threads else f"{by_threads[n]['agree_steps']}/{new_tokens}" for n in counts]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Decode ms per token, one bar per engine and weight format at each thread count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvports.shared.files import write_atomic

    counts = sorted({threads(result) for result in results})
    table = lines(results)
    height = 0.8 / len(counts)
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(table) + 2.2))
    colors = ("#0072B2", "#D55E00", "#009E73", "#CC79A7")
    loads = {threads(result): result["machine"]["load_average"] for result in results}
    for index, n in enumerate(counts):
        values = [by_threads.get(n, {}).get("decode_ms_per_token") for _, _, by_threads in table]
        positions = [line + index * height for line in range(len(table))]
        bars = ax.barh(
            positions,
            [v or 0 for v in values],
            height,
            color=colors[index % len(colors)],
            label=f"{n} thread(s), load average {loads[n][0]} / {loads[n][1]} before / after",
        )
        ax.bar_label(bars, labels=[figure(v, ".1f") for v in values], padding=2, fontsize=7)
    ax.set_yticks([line + height * (len(counts) - 1) / 2 for line in range(len(table))])
    ax.set_yticklabels([f"{name}: {weights}" for name, weights, _ in table], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("decode ms per token (lower is faster)")
    settings = results[0]["settings"]
    ax.set_title(
        f"{settings['preset']}: cached decode, batch {settings['batch']}, prompt {settings['prompt_len']}, "
        f"{settings['new_tokens']} new tokens",
        fontsize=9,
    )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), fontsize=8)  # below the axis, off the bars
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, buffer.getvalue())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path, default=RUNS, help="bench --peers --json outputs")
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG", help="write the figure here too")
    args = parser.parse_args(argv)
    results = read_runs(args.runs)
    sys.stdout.write(markdown(results))
    if args.plot is not None:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
