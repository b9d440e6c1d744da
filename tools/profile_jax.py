"""Where JAX's cached decode step on SmolLM2 spends its time, per XLA operation: each mode's model
(dtype and quant) loaded once, a streamed generation timed (the decode ms a step, as the bench's),
then a second one under jax.profiler, whose trace (XLA's CPU runtime records every thunk it runs:
a dot, a fusion, a copy) is read back with jax.profiler.ProfileData and summed per kind of thunk
(`dot.17` and `dot.301` are one kind: `dot`). What the step's single compiled call does inside.

    python tools/profile_jax.py [--modes float32:none,bfloat16:none] [--threads 1] [--steps 24]

JAX sizes its thread pool once, when it starts: --threads sets it (NPROC) before JAX is imported.
docs/BENCH.md reports its figures. Timings only: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, kvports importable or not

MODES = "float32:none,bfloat16:none"  # dtype:quant
PROMPT = [[1, 2, 3, 4, 5]]  # the seed's prompt
KIND = re.compile(r"\.\d+$")  # an HLO instruction's number: dot.17 -> dot


def step_ms(model: object, steps: int) -> float:
    """The median decode ms a step of a streamed generation (steps 1..N-1, as the bench's tg)."""
    from kvports.jax_impl import port

    arrived: list[float] = []
    port.generate(
        model, np.array(PROMPT), steps + 1, "cached", on_token=lambda token: arrived.append(time.perf_counter())
    )
    return 1e3 * float(np.median(np.diff(arrived)))


def thunk_times(model: object, steps: int) -> dict[str, dict[str, tuple[float, float]]]:
    """{compiled program: {kind of thunk: (calls a decode step, ms a decode step)}} over every thunk XLA ran
    in a profiled generation; a program that runs once (the prefill's) is spread over the steps too."""
    import jax
    from jax.profiler import ProfileData

    from kvports.jax_impl import port

    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        try:
            port.generate(model, np.array(PROMPT), steps + 1, "cached", on_token=lambda token: None)
        finally:
            jax.profiler.stop_trace()
        (trace,) = Path(folder).rglob("*.xplane.pb")
        data = ProfileData.from_file(str(trace))
    calls: dict[tuple[str, str], int] = defaultdict(int)
    spent: dict[tuple[str, str], float] = defaultdict(float)
    for plane in data.planes:
        for line in plane.lines:
            if "XLA" not in line.name:  # the runtime's threads; the python line times the calls from outside
                continue
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" not in stats:  # a whole program's run, not one of its thunks
                    continue
                key = (str(stats.get("hlo_module", "?")), KIND.sub("", event.name))
                calls[key] += 1
                spent[key] += event.duration_ns
    found: dict[str, dict[str, tuple[float, float]]] = defaultdict(dict)
    for (program, kind), ns in spent.items():
        found[program][kind] = (calls[(program, kind)] / steps, ns / 1e6 / steps)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=MODES, help=f"comma-separated dtype:quant (default {MODES})")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="JAX's thread pool, and float32's row loop (default: its own pool, XLA's dots)",
    )
    parser.add_argument("--steps", type=int, default=24, help="decode steps per generation (default 24)")
    parser.add_argument("--top", type=int, default=12, help="kinds of thunk listed per mode (default 12)")
    args = parser.parse_args(argv)
    from kvports.threads import settle_threads, use_threads

    use_threads(args.threads)  # before JAX starts: its pool is sized once
    import jax

    from kvports.formats.weights import open_weights
    from kvports.hub import model_path
    from kvports.jax_impl import port

    settle_threads()  # with --threads, the row loop is installed now that the port is loaded
    modes = [tuple(mode.split(":")) for mode in args.modes.split(",")]
    with open_weights(model_path("smollm2")) as file:
        config, tensors = file.config, file.read("float32", quant="q4")  # q4's blocks beside the floats
    print(
        f"jax {jax.__version__}, NPROC {os.environ.get('NPROC', 'unset')}, load average {os.getloadavg()[0]:.1f}; "
        f"{args.steps} decode steps after a {len(PROMPT[0])}-token prompt"
    )
    for dtype, quant in modes:
        model = port.load_model(config, tensors, dtype, quant=quant)
        step_ms(model, args.steps)  # compiles
        wall = step_ms(model, args.steps)
        programs = thunk_times(model, args.steps)
        print(f"\n{dtype}:{quant}: {wall:.2f} ms a decode step")
        for program, per_step in sorted(programs.items(), key=lambda item: -sum(ms for _, ms in item[1].values())):
            total = sum(ms for _, ms in per_step.values())
            print(f"  {program}: its thunks {total:.2f} ms a step (summed over XLA's threads, under the profiler)")
            print(f"    {'thunk':34s} {'calls/step':>10s} {'ms/step':>8s} {'us/call':>8s} {'share':>6s}")
            for kind, (count, ms) in sorted(per_step.items(), key=lambda item: -item[1][1])[: args.top]:
                print(f"    {kind[:34]:34s} {count:10.1f} {ms:8.2f} {1e3 * ms / count:8.1f} {ms / total:6.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
