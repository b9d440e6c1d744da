"""A port's SmolLM2 decode at 2 threads with its split (fast/cores.py) on and off, interleaved in one
process, so that a loaded machine's noise falls on both alike (docs/BENCH.md, "Every thread a
decode step is given"). NumPy's third column is OpenBLAS's own 2 threads, the port before the split.

    python tools/profile_cores.py numpy     # or torch; needs `kvports fetch smollm2`
    python tools/profile_cores.py numpy --prefill 512   # NumPy's prompt attention: lesson's, one thread's, split

`--prefill P` times a P-token prompt's prefill (tokens/s) instead, OpenBLAS at 2 threads in every
setting: the lesson's attention, fast/cores.py's PromptAttention on one thread (its causal blocks alone)
and on 2 (the blocks split across the threads, what `--threads 2` installs).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

from threadpoolctl import threadpool_limits

import kvports
from kvports.threads import use_threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("framework", choices=["numpy", "torch"])
    parser.add_argument("--tokens", type=int, default=33)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefill", type=int, default=0, help="time a prompt of this many tokens instead (NumPy)")
    args = parser.parse_args()
    use_threads(2)
    model = kvports.load(args.framework, model="smollm2")
    cores = importlib.import_module(f"kvports.{args.framework}_impl.fast.cores")
    if args.prefill:
        return time_prefill(model, cores, args.prefill, args.rounds)
    # name -> (split threads, BLAS threads): OpenBLAS at 1 inside the split, as use_threads sets it
    settings = {"split": (2, 1), "unsplit": (1, 1)} | ({"openblas 2": (1, 2)} if args.framework == "numpy" else {})
    seconds: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(args.rounds):
        for name, (split, blas) in settings.items():
            cores.split_products(split)
            threadpool_limits(blas, user_api="blas")
            start = time.perf_counter()
            model.generate([[1, 2, 3, 4, 5]], args.tokens, mode="cached")
            seconds[name].append(time.perf_counter() - start)
    medians = {name: round(statistics.median(values), 3) for name, values in seconds.items()}
    with open("/proc/loadavg") as load:
        print(f"{args.framework}, 2 threads, {args.tokens} tokens, median of {args.rounds} interleaved (s): {medians}")
        print(f"load average {' '.join(load.read().split()[:3])}")


def time_prefill(model, cores, tokens: int, rounds: int) -> None:
    from kvports.numpy_impl import functional

    prompt = [list(range(1, tokens + 1))]  # [1, P]
    settings = {
        "lesson": cores.PLAIN_ATTENTION,
        "prompt attention, 1 thread": cores.PromptAttention(1).attention,
        "prompt attention, 2 threads": cores.PromptAttention(2).attention,
    }
    seconds: dict[str, list[float]] = {name: [] for name in settings}
    logits = {}
    for _ in range(rounds):
        for name, attention in settings.items():
            functional.scaled_dot_product_attention = attention
            start = time.perf_counter()
            logits[name] = model.generate(prompt, 1, mode="cached", return_logits=True).logits
            seconds[name].append(time.perf_counter() - start)
    functional.scaled_dot_product_attention = cores.PLAIN_ATTENTION
    rates = {name: round(tokens / statistics.median(values)) for name, values in seconds.items()}
    moved = max(float(abs(value - logits["lesson"]).max()) for value in logits.values())
    with open("/proc/loadavg") as load:
        print(f"numpy, {tokens}-token prefill, OpenBLAS 2 threads, median of {rounds} interleaved: {rates} tokens/s")
        print(f"largest |logit - the lesson's|: {moved:.2g}; load average {' '.join(load.read().split()[:3])}")


if __name__ == "__main__":
    main()
