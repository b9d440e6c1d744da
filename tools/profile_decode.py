"""Where torch's cached decode step on SmolLM2 spends its time, per mode: each mode's model
(dtype and quant) loaded once in one process, decode steps timed in interleaved rounds (a shared
machine moves every figure; the medians of the rounds are what to compare), and, with
--torch-profile, torch.profiler's per-op table of each mode (which kernel each product takes); with
--modules, each kind of module's wall time a step, taken by forward hooks (no profiler overhead on
the ops inside: what a product costs in its place in the step, beside what it costs alone).

    OMP_NUM_THREADS=1 python tools/profile_decode.py [--modes float32:none,bfloat16:q4] [--rounds 5] [--modules]

docs/BENCH.md reports its figures. Timings only: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, kvports importable or not

MODES = "float32:none,bfloat16:none,bfloat16:int8,bfloat16:q4"  # dtype:quant
PROMPT = (1, 2, 3, 4, 5)  # the seed's prompt


def decode_steps(model: object, steps: int) -> list[float]:
    """Seconds for each of `steps` one-token forwards against a cache the prompt filled."""
    import torch

    from kvports.torch_impl.model import init_cache

    with torch.inference_mode():
        cache = init_cache(model.config, 1, len(PROMPT) + steps, model.emb.weight.dtype)  # type: ignore[attr-defined]
        logits, cache = model(torch.tensor([PROMPT]), cache)  # type: ignore[operator]
        seconds = []
        for _ in range(steps):
            start = time.perf_counter()
            logits, cache = model(logits[:, -1:].argmax(-1), cache)  # type: ignore[operator]
            seconds.append(time.perf_counter() - start)
    return seconds


def module_times(model: object, steps: int) -> dict[str, float]:
    """Seconds a decode step spends in each kind of module (a block's qkv, ffn.0, ln1, ...; the head), by hooks."""
    from collections import defaultdict

    spent: dict[str, float] = defaultdict(float)
    started: dict[str, float] = {}
    handles = []
    for name, module in model.named_modules():  # type: ignore[attr-defined]
        parts = name.split(".")
        if not name or parts[0] == "blocks" and len(parts) == 2 or name == "blocks":
            continue
        kind = ".".join(parts[2:]) if parts[0] == "blocks" else name  # blocks.7.ffn.0 -> ffn.0

        def before(module: object, inputs: object, name: str = name) -> None:
            started[name] = time.perf_counter()

        def after(module: object, inputs: object, output: object, name: str = name, kind: str = kind) -> None:
            spent[kind] += time.perf_counter() - started[name]

        handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    try:
        decode_steps(model, steps)
    finally:
        for handle in handles:
            handle.remove()
    return {kind: seconds / (steps + 1) for kind, seconds in spent.items()}  # the prompt's forward counted too


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=MODES, help=f"comma-separated dtype:quant (default {MODES})")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per round (default 16)")
    parser.add_argument("--torch-profile", action="store_true", help="also torch.profiler's table for each mode")
    parser.add_argument("--modules", action="store_true", help="also each kind of module's ms a step, by hooks")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="as kvports --threads: the count, and float32's row loop (default: none)",
    )
    args = parser.parse_args(argv)
    from kvports.threads import settle_threads, use_threads

    use_threads(args.threads)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvports.formats.weights import open_weights
    from kvports.hub import model_path
    from kvports.torch_impl import port

    settle_threads()  # with --threads, the row loop is installed now that the port is loaded

    modes = [tuple(mode.split(":")) for mode in args.modes.split(",")]
    with open_weights(model_path("smollm2")) as file:
        config, tensors = file.config, file.read("float32", quant="q4")  # q4's blocks beside the floats
    models = {mode: port.load_model(config, tensors, mode[0], quant=mode[1]) for mode in modes}
    medians: dict[tuple[str, ...], list[float]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode, model in models.items():
            medians[mode].append(float(np.median(decode_steps(model, args.steps))))
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}; "
        f"decode ms per step, median of {args.rounds} rounds (each round's median of {args.steps} steps)"
    )
    for mode, values in medians.items():
        print(
            f"{':'.join(mode):16s} {1e3 * np.median(values):7.2f}   rounds {' '.join(f'{1e3 * v:.1f}' for v in values)}"
        )
    if args.modules:
        for mode, model in models.items():
            print(f"\n{':'.join(mode)}, ms a step by module (forward hooks; a module's time includes its children's)")
            for kind, seconds in sorted(module_times(model, args.steps).items(), key=lambda item: -item[1]):
                print(f"  {kind:14s} {1e3 * seconds:7.2f}")
    if args.torch_profile:
        for mode, model in models.items():
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiled:
                decode_steps(model, args.steps)
            print(f"\n{':'.join(mode)}, {args.steps} decode steps")
            averages = profiled.key_averages(group_by_input_shape=True)
            print(averages.table(sort_by="self_cpu_time_total", row_limit=12, max_shapes_column_width=60))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
