"""What `kvports bench` prints and writes: JSON or the table (table.py) on stdout, and with
--csv a header then one line per row with the settings that make it comparable (to a file,
written atomically, or with `--csv -` to stdout instead of the table)."""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from typing import Any

from kvports.bench.table import print_table
from kvports.shared.files import write_atomic

CSV_FIELDS = (
    "framework",
    "variant",
    "mode",
    "available",
    "device",
    "dtype",
    "weights",
    "quant",
    "ttft_ms",
    "decode_ms_per_token",
    "decode_ms_p90",
    "tokens_per_s",
    "total_s",
    "total_ms_per_token",
    "compile_s",
    "kv_cache_bytes",
    "roofline_ms",
    "roofline_ratio",
    "decode_speedup_vs_seed_concat",
    "total_speedup_vs_naive",
    "speedup_vs_cached",
    "acceptance_rate",
    "target_forwards_per_token",
    "tokens_agree",
    "agree_steps",
    "reason",
)


def to_csv(result: dict[str, Any]) -> str:
    settings = result["settings"]
    columns = ("preset", "batch", "prompt_len", "new_tokens") + CSV_FIELDS
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in result["rows"]:
        writer.writerow({**{key: settings[key] for key in columns[:4]}, **row, **(row.get("speculative") or {})})
    return buffer.getvalue()


def print_result(result: dict[str, Any], args: argparse.Namespace) -> None:
    """--json: one object; --csv -: the CSV; else the table (with --targets, the targets too).
    --csv FILE writes the CSV beside either; the files written are listed after the table."""
    to_stdout = args.csv is not None and str(args.csv) == "-"
    if args.csv is not None and not to_stdout:
        write_atomic(args.csv, to_csv(result).encode())
    if args.json:
        print(json.dumps(result))
    elif to_stdout:
        sys.stdout.write(to_csv(result))
    else:
        print_table(result, args.targets)
        for path in [*result.get("plots", []), *([] if args.csv is None else [args.csv])]:
            print(f"wrote {path}")
