"""docs/BENCH.md's table and figure of kvports beside llama.cpp and CTranslate2, from the JSON of
one `kvports bench --peers --threads 1,2 --json` run: one line per engine and weight format, and at
each thread count llama-bench's two figures (pp, prompt tokens/s; tg, generated tokens/s), the row's
ratio to the peer its format is held to, its roofline ratio and the leading tokens that agree with
the float32 reference. Runs saved one per thread count (older JSON, rows without `threads`) are
read as well, each at its own count.

    python tools/peers_report.py docs/data/peers_smollm2.json --plot docs/img/peers_smollm2.png --doc docs/BENCH.md

--doc rewrites the table in place, between the document's BEGIN and END markers below.
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

RUNS = [ROOT / "docs" / "data" / "peers_smollm2.json"]  # the committed run
FIGURE = ROOT / "docs" / "img" / "peers_smollm2.png"
BEGIN = "<!-- peers table: written by tools/peers_report.py --doc -->"
END = "<!-- end of peers table -->"


def read_runs(paths: list[Path]) -> list[dict[str, Any]]:
    return [json.loads(Path(path).read_text()) for path in paths]


def threads(result: dict[str, Any], row: dict[str, Any]) -> int:
    """The thread count the row ran at: its own, else its run's (the peers' count is the ports')."""
    count = row.get("threads")
    return int(count if count is not None else result["settings"]["threads"].get("peers", 0))


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
                table.setdefault((engine(row), str(row["weights"])), {})[threads(result, row)] = row
    return [(name, weights, by_threads) for (name, weights), by_threads in table.items()]


def counts_of(results: list[dict[str, Any]]) -> list[int]:
    return sorted({threads(result, row) for result in results for row in result["rows"]})


def loads(results: list[dict[str, Any]]) -> str:
    """The load averages before and after, of the run and of each process it ran."""
    parts = []
    for result in results:
        machine = result["machine"]
        parts.append(f"{machine['load_average'][0]} / {machine['load_average'][1]}")
        parts += [
            f"round {run['round']} at {run['threads']} thread(s): {run['load_average'][0]} / {run['load_average'][1]}"
            for run in machine.get("runs", [])
        ]
    return "; ".join(parts)


def figure(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def markdown(results: list[dict[str, Any]]) -> str:
    counts = counts_of(results)
    settings = results[0]["settings"]
    new_tokens, pp = settings["new_tokens"], settings.get("pp")
    reference = next(row["agree_reference"] for row in results[0]["rows"] if row["available"])
    columns = [
        (f"pp{pp} tok/s", lambda row: figure(row.get("pp_tokens_per_s"), ",.0f")),
        (f"tg{new_tokens} tok/s", lambda row: figure(row.get("tg_tokens_per_s"), ".1f")),
        ("tg x peer", lambda row: figure(row.get("tg_vs_peer"), ".2f", "x")),
        ("pp x peer", lambda row: figure(row.get("pp_vs_peer"), ".2f", "x")),
        ("x roofline", lambda row: figure(row.get("roofline_ratio"), ".2f", "x")),
        ("agree", lambda row: f"{row['agree_steps']}/{new_tokens}"),
    ]
    header = ["engine", "weights", "held to"] + [f"{name}, {n} thr" for n in counts for name, _ in columns]
    out = ["| " + " | ".join(header) + " |", "|---|---|---|" + "---:|" * (len(header) - 3)]
    for name, weights, by_threads in lines(results):
        held = next((row.get("held_to") for row in by_threads.values() if row.get("held_to")), None) or "-"
        cells = [name, weights, held]
        for n in counts:
            row = by_threads.get(n)
            cells += ["-" if row is None else cell(row) for _, cell in columns]
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    out.append(f"Agree: the leading new tokens equal to {reference}'s. Load average before / after: {loads(results)}.")
    out += targets_table(results, counts)
    return "\n".join(out) + "\n"


def targets_table(results: list[dict[str, Any]], counts: list[int]) -> list[str]:
    """The run's peer targets (`bench.targets`), met or missed, a line each with its figure at each thread
    count; nothing where no peer ran."""
    found: dict[str, dict[int, dict[str, Any]]] = {}
    for result in results:
        for target in result.get("targets", []):
            if target.get("threads") is not None:
                found.setdefault(target["target"], {})[int(target["threads"])] = target
    if not found:
        return []
    out = ["", "| target | " + " | ".join(f"{n} thr" for n in counts) + " |", "|---|" + "---|" * len(counts)]
    for name, by_threads in found.items():
        cells = [
            "-"
            if n not in by_threads
            else f"{by_threads[n]['value']:.3f}x, {'met' if by_threads[n]['met'] else 'missed'}"
            for n in counts
        ]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """llama-bench's two figures side by side, tg and pp tokens/s, one bar per engine and weight format at
    each thread count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvports.shared.files import write_atomic

    counts = counts_of(results)
    table = lines(results)
    settings = results[0]["settings"]
    height = 0.8 / len(counts)
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.42 * len(table) + 2.4), sharey=True)
    colors = ("#0072B2", "#D55E00", "#009E73", "#CC79A7")
    panels = (
        ("tg_tokens_per_s", f"tg{settings['new_tokens']}: generated tokens/s (higher is faster)", ".1f"),
        ("pp_tokens_per_s", f"pp{settings.get('pp')}: prompt tokens/s (higher is faster)", ".0f"),
    )
    for ax, (key, label, spec) in zip(axes, panels, strict=True):
        for index, n in enumerate(counts):
            values = [by_threads.get(n, {}).get(key) for _, _, by_threads in table]
            positions = [line + index * height for line in range(len(table))]
            bars = ax.barh(
                positions, [v or 0 for v in values], height, color=colors[index % len(colors)], label=f"{n} thread(s)"
            )
            ax.bar_label(bars, labels=[figure(v, spec) for v in values], padding=2, fontsize=6)
        ax.set_xlabel(label, fontsize=8)
        ax.margins(x=0.15)
    axes[0].set_yticks([line + height * (len(counts) - 1) / 2 for line in range(len(table))])
    axes[0].set_yticklabels([f"{name}: {weights}" for name, weights, _ in table], fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(
        f"{settings['preset']}: batch {settings['batch']}, cached; load average before / after {loads(results)}",
        fontsize=8,
        wrap=True,
    )
    axes[0].legend(loc="upper center", bbox_to_anchor=(1.0, -0.1), fontsize=8, ncol=len(counts))
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, buffer.getvalue())


def write_doc(path: Path, table: str) -> None:
    """The document with the text between BEGIN and END replaced by `table` (both markers must be there)."""
    from kvports.shared.files import write_atomic

    text = path.read_text()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} section to rewrite")
    write_atomic(path, (text[: start + len(BEGIN)] + "\n" + table + text[end:]).encode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "runs", nargs="*", type=Path, default=RUNS, help="bench --peers --json outputs (default the committed run)"
    )
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG", help="write the figure here too")
    parser.add_argument("--doc", type=Path, default=None, metavar="MD", help="rewrite the table between its markers")
    args = parser.parse_args(argv)
    results = read_runs(args.runs)
    sys.stdout.write(markdown(results))
    if args.doc is not None:
        write_doc(args.doc, markdown(results))
    if args.plot is not None:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
