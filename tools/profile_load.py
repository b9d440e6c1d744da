"""How long the fetched SmolLM2 takes to be ready, side by side in one run: kvports' load (from the
load cache, after a first run filled it) in NumPy and torch, llama-cpp-python's load of the same
file, the whole second `kvports generate --chat Hi --new-tokens 1` per port, and JAX's compiles on
its second run (persistent-cache hits). Each figure in a fresh process; loads exclude importing the
framework, as llama-cpp-python's excludes importing llama_cpp.

    python tools/profile_load.py   # needs `make model`; llama-cpp-python optional; fills $KVPORTS_HOME's caches
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

RUNS = 3
LOAD = (
    "import kvports, resource, time; from kvports import loading; loading.load_port({fw!r}); t = time.perf_counter(); "
    "kvports.load({fw!r}, model='smollm2', threads=1); "
    "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)"
)
LLAMA = (
    "import llama_cpp, resource, time; from kvports.hub import model_path; path = str(model_path('smollm2')); "
    "t = time.perf_counter(); "
    "llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=1, verbose=False, use_extra_bufts=False); "
    "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)"
)


def in_process(code: str) -> tuple[float, int] | None:
    """(seconds, peak RSS in MB) that `code` prints, or None where it fails (llama_cpp missing)."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if result.returncode != 0:
        return None
    seconds, rss = result.stdout.split()[:2]
    return float(seconds), int(rss)


def command(framework: str) -> tuple[float, str]:
    """The whole `kvports generate` command: its wall seconds, and what JAX says of its compiles."""
    kvports = str(Path(sys.executable).parent / "kvports")
    argv = [kvports, "generate", "--framework", framework, "--mode", "cached", "--model", "smollm2"]
    argv += ["--chat", "Hi", "--new-tokens", "1", "--threads", "1"]
    start = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "JAX_LOG_COMPILES": "1"})
    wall = time.perf_counter() - start
    if framework != "jax":
        return wall, ""
    compiles = [float(s) for s in re.findall(r"Finished XLA compilation of .* in ([0-9.]+) sec", result.stderr)]
    hits = result.stderr.count("Persistent compilation cache hit")
    return (
        wall,
        f"; {len(compiles)} XLA programs, {hits} persistent-cache hits, {sum(compiles):.2f} s compiling or loading",
    )


def main() -> int:
    for framework in ("numpy", "torch", "jax"):
        command(framework)  # the first run: the load cache and JAX's cache filled, if they were not
    rows = {"llama-cpp-python": LLAMA, **{f"kvports.load {fw}": LOAD.format(fw=fw) for fw in ("numpy", "torch")}}
    for name, code in rows.items():
        runs = [in_process(code) for _ in range(RUNS)]
        if any(run is None for run in runs):
            print(f"{name:18s} not run (not installed)")
            continue
        seconds = ", ".join(f"{run[0]:.3f}" for run in runs if run is not None)
        print(f"{name:18s} ready in {seconds} s; peak RSS {max(run[1] for run in runs if run is not None)} MB")
    for framework in ("numpy", "torch", "jax"):
        wall, compiles = command(framework)
        print(f"second kvports generate --framework {framework}: {wall:.2f} s wall{compiles}")
    print("load average:", " ".join(Path("/proc/loadavg").read_text().split()[:3]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
