"""Where the NumPy port's float32 decode step at SmolLM2's shapes goes: each product in both
memory orders of its (out, in) weight (row-major "C", where x @ weight.T is OpenBLAS's gemv over
(out, in) rows, and column-major "F", over [in, out] rows; numpy_impl/fast/layout.py's memory_order
picks one per shape), streamed as the model streams them (30 distinct weights per shape, the head once), in interleaved
rounds; then the real model's cached step with and without its products (every F.linear answered
from a table), which leaves the ~hundreds of small element-wise calls, the cache write and the
Python around them.

    python tools/profile_numpy.py [--rounds 9] [--threads 1]

Timings only: nothing here is asserted. On a shared machine compare the paired ratios, not the times.
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

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576))  # (out, in)
LAYERS = 30


def time_orders(rounds: int) -> None:
    from kvports.numpy_impl.fast.layout import memory_order

    rng = np.random.default_rng(0)
    print(f"us per product (GB/s), median of {rounds} interleaved rounds; load average {os.getloadavg()[0]:.1f}")
    for out, inn in SHAPES:
        count = 1 if out * inn > 1 << 24 else LAYERS  # the head is streamed by itself
        weights = [rng.standard_normal((out, inn), dtype=np.float32) for _ in range(count)]  # [out, in] each
        x = rng.standard_normal((1, inn), dtype=np.float32)  # [1, in]
        orders = {order: [np.asarray(w, order=order) for w in weights] for order in "CF"}
        seconds: dict[str, list[float]] = {"C": [], "F": []}
        for _ in range(rounds):
            for order, stored in orders.items():
                start = time.perf_counter()
                for w in stored:
                    x @ w.T  # [1, out]
                seconds[order].append((time.perf_counter() - start) / count)
        cells = [
            f"{o} {1e6 * np.median(s):7.0f} ({4 * out * inn / np.median(s) / 1e9:4.1f})" for o, s in seconds.items()
        ]
        ratio = np.median(np.array(seconds["F"]) / np.array(seconds["C"]))
        print(f"{out}x{inn}: {' | '.join(cells)} | paired F/C {ratio:.2f}; the port stores {memory_order(weights[0])}")


def time_step(rounds: int, steps: int = 32) -> None:
    import kvports.numpy_impl.functional as F
    from kvports.formats.weights import open_weights
    from kvports.hub import model_path
    from kvports.numpy_impl import port
    from kvports.numpy_impl.model import init_cache

    with open_weights(model_path("smollm2")) as file:
        model = port.load_model(file.config, file.read("float32"))
    P = 16
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, P))  # [1, P]
    cache = init_cache(model.config, 1, P + steps, np.float32)
    model(prompt, cache)
    token = np.array([[5]])  # [1, 1]
    real = F.linear
    answers: dict[tuple[tuple[int, ...], tuple[int, ...]], np.ndarray] = {}

    def answered(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        key = (x.shape, weight.shape)
        if key not in answers:
            answers[key] = real(x, weight, bias)
        return answers[key].copy()  # a fresh array, as a product's

    seconds: dict[str, list[float]] = {"whole step": [], "without its products": []}
    for _ in range(rounds):
        for name, linear in (("whole step", real), ("without its products", answered)):
            F.linear = linear  # type: ignore[assignment]
            cache.crop(P)
            start = time.thread_time()
            for _ in range(steps):
                model(token, cache)
            seconds[name].append((time.thread_time() - start) / steps)
    F.linear = real  # type: ignore[assignment]
    print(
        "SmolLM2 cached step, ms of CPU time (median of rounds): "
        + ", ".join(f"{name} {1e3 * np.median(s):.2f}" for name, s in seconds.items())
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument("--threads", type=int, default=1, help="OpenBLAS threads (default 1)")
    args = parser.parse_args(argv)
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=args.threads)
    time_orders(args.rounds)
    time_step(args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
