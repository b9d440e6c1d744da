"""What `kvports bench` prints on stdout: JSON, CSV (a header, then one line per row with the
settings that make it comparable) or the table (table.py)."""

from __future__ import annotations

import csv
import io
import json
import sys
from typing import Any

from kvports.shared.bench.table import print_table

CSV_FIELDS = (
    "framework",
    "variant",
    "mode",
    "available",
    "device",
    "dtype",
    "ttft_ms",
    "decode_ms_per_token",
    "decode_ms_p90",
    "tokens_per_s",
    "total_s",
    "compile_s",
    "kv_cache_bytes",
    "roofline_ms",
    "roofline_ratio",
    "decode_speedup_vs_seed_concat",
    "total_speedup_vs_naive",
    "tokens_agree",
    "reason",
)


def to_csv(result: dict[str, Any]) -> str:
    settings = result["settings"]
    columns = ("preset", "batch", "prompt_len", "new_tokens") + CSV_FIELDS
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in result["rows"]:
        writer.writerow({**{key: settings[key] for key in columns[:4]}, **row})
    return buffer.getvalue()


def print_result(result: dict[str, Any], form: str) -> None:
    """`json`: one object; `csv`: to_csv's lines; `table`: the table, then the plots written."""
    if form == "json":
        print(json.dumps(result))
    elif form == "csv":
        sys.stdout.write(to_csv(result))
    else:
        print_table(result)
        for path in result.get("plots", []):
            print(f"wrote {path}")
