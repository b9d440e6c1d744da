"""Where a float32 decode step at SmolLM2's shapes spends its products: each matrix-vector product
(960x576 qkv, 576x576 proj, 3072x576 gate/up, 576x1536 down, the 49152x576 head) through
torch's oneDNN linear, F.linear (MKL), NumPy (OpenBLAS) and JAX (XLA:CPU), streamed as the
model streams them (30 distinct weights per shape, one per layer), in interleaved rounds; and,
with --torch-profile, torch.profiler's per-op table over a cached generation of the real model.

    OMP_NUM_THREADS=1 python tools/profile_products.py [--rounds 5] [--torch-profile]

docs/BENCH.md reports its figures. Timings only: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, kvports importable or not

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576))  # (out, in)
LAYERS = 30


def products(out: int, inn: int, rng: np.random.Generator) -> tuple[int, dict[str, Callable[[], object]]]:
    """(weights per call, library -> a call of every product over them)."""
    import jax
    import jax.numpy as jnp
    import torch
    import torch.nn.functional as F

    from kvports.torch_impl.fast.onednn import _onednn_linear

    count = 1 if out * inn > 1 << 24 else LAYERS  # the head is streamed by itself
    weights = [rng.standard_normal((out, inn)).astype(np.float32) for _ in range(count)]  # [out, in] each
    x = rng.standard_normal((1, inn)).astype(np.float32)  # [1, in]
    torch_weights, torch_x = [torch.from_numpy(w) for w in weights], torch.from_numpy(x)
    kernels = [jnp.asarray(np.ascontiguousarray(w.T)) for w in weights]  # nnx.Linear's layout: [in, out]
    jax_x = jnp.asarray(x)
    jax_products = jax.jit(lambda x, kernels: [x @ kernel for kernel in kernels])
    calls: dict[str, Callable[[], object]] = {}
    if _onednn_linear is not None:
        calls["oneDNN linear"] = lambda: [_onednn_linear(torch_x, w, None, "none", [], "") for w in torch_weights]
    calls["F.linear (MKL)"] = lambda: [F.linear(torch_x, w) for w in torch_weights]
    calls["numpy (BLAS)"] = lambda: [x @ w.T for w in weights]
    calls["jax (XLA)"] = lambda: jax_products(jax_x, kernels)[-1].block_until_ready()
    return count, calls


def time_products(rounds: int) -> None:
    import torch

    rng = np.random.default_rng(0)
    table = {shape: products(*shape, rng) for shape in SHAPES}
    seconds: dict[tuple[tuple[int, int], str], list[float]] = {}
    with torch.no_grad():
        for _ in range(rounds):
            for shape, (count, calls) in table.items():
                for name, call in calls.items():
                    call()  # warm: compiled, first-touch pages
                    start = time.perf_counter()
                    call()
                    seconds.setdefault((shape, name), []).append((time.perf_counter() - start) / count)
    print(
        f"threads: torch {torch.get_num_threads()}, OMP_NUM_THREADS {os.environ.get('OMP_NUM_THREADS')}; "
        f"load average {os.getloadavg()[0]:.1f}; us per product (GB/s), median of {rounds}"
    )
    for shape, (_, calls) in table.items():
        cells = []
        for name in calls:
            median = float(np.median(seconds[(shape, name)]))
            cells.append(f"{name} {1e6 * median:8.1f} ({4 * shape[0] * shape[1] / median / 1e9:4.1f})")
        print(f"{shape[0]}x{shape[1]}: " + " | ".join(cells))


def torch_profile(new_tokens: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvports.formats.weights import open_weights
    from kvports.hub import model_path
    from kvports.torch_impl import port

    with open_weights(model_path("smollm2")) as file:
        model = port.load_model(file.config, file.read("float32"))
    prompts = np.array([[1, 2, 3, 4, 5]])  # [1, P]
    port.generate(model, prompts, 4, "cached")
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        port.generate(model, prompts, new_tokens, "cached")
    print(f"torch threads {torch.get_num_threads()}, {new_tokens} new tokens")
    print(profiled.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--torch-profile", action="store_true", help="also torch.profiler over the real model")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens the profiled generation makes")
    args = parser.parse_args(argv)
    time_products(args.rounds)
    if args.torch_profile:
        torch_profile(args.new_tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
