"""`kvports bench --requests N`: `kvports batch --bench`'s two workloads, N requests each
(continuous batching against the same requests one at a time, `throughput.py`)."""

from __future__ import annotations

import argparse

from kvports import registry
from kvports.bench.options import batching_inputs, bench_defaults
from kvports.bench.throughput import run_bench


def run(args: argparse.Namespace) -> int:
    return run_bench(batching_inputs(args, bench_defaults(), registry.PORTS))
