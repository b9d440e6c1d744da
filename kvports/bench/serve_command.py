"""`kvports bench --serve`: a kvports serve per port (and llama.cpp's server) under concurrent
clients (`serving.py`)."""

from __future__ import annotations

import argparse

from kvports.bench.options import bench_defaults


def run(args: argparse.Namespace) -> int:
    from kvports.bench.serving import SERVING_FLAGS, run_serving, serving_inputs

    defaults = bench_defaults()
    changed = [name for name, value in defaults.items() if name not in SERVING_FLAGS and getattr(args, name) != value]
    return run_serving(serving_inputs(args, changed))
