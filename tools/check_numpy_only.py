"""The NumPy-only install, checked: run with the Python of a venv holding kvports without extras
(`make check-numpy-only` builds one). torch and JAX must be absent; generate and init-weights --init numpy
must work with NumPy;
compare and bench must run and report the missing frameworks as unavailable."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

KVPORTS = str(Path(sys.executable).with_name("kvports"))


def run(*argv: str) -> str:
    result = subprocess.run([KVPORTS, *argv], capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        sys.exit(f"kvports {' '.join(argv)} exited {result.returncode}:\n{result.stderr}")
    return result.stdout


def check(condition: bool, what: str) -> None:
    if not condition:
        sys.exit(f"numpy-only check failed: {what}")
    print(f"ok: {what}")


def main() -> None:
    os.chdir(tempfile.mkdtemp())  # the installed kvports, never a checkout in the working directory
    for name in ("torch", "jax", "flax", "transformers"):
        check(importlib.util.find_spec(name) is None, f"{name} is not installed")
    generated = json.loads(run("generate", "--framework", "numpy", "--mode", "cached", "--new-tokens", "5", "--json"))
    check(
        generated["tokens"] == [[160, 248, 104, 209, 394, 315, 391, 221, 120, 342]],
        "kvports generate --framework numpy --mode cached gives the seed's golden tokens",
    )
    compared = json.loads(run("compare", "--json", "--new-tokens", "5"))
    unavailable = sorted({row["framework"] for row in compared["rows"] if not row["available"]})
    check(compared["reference"] == "numpy naive" and compared["ok"], "kvports compare takes numpy naive as reference")
    check(unavailable == ["jax", "torch"], "kvports compare reports torch and jax as not installed")
    table = run("compare", "--new-tokens", "5")
    check(table.count("not installed") == 4, "kvports compare's table says so, row by row")
    run("init-weights", "--init", "numpy", "--out", "numpy-init.safetensors")
    drawn = json.loads(
        run(
            "generate",
            "--framework",
            "numpy",
            "--mode",
            "cached",
            "--weights",
            "numpy-init.safetensors",
            "--new-tokens",
            "3",
            "--json",
        )
    )
    check(len(drawn["tokens"][0]) == 8, "kvports init-weights --init numpy writes a model without torch")
    code = "import kvports; print(kvports.load('numpy').generate([160, 248, 104, 209, 394], new_tokens=3).generated)"
    api = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    check(api.stdout.strip() == "[[315, 391, 221]]", "the Python API generates with numpy alone")
    benched = json.loads(run("bench", "--json", "--new-tokens", "3", "--repeats", "1"))
    live = [row["framework"] for row in benched["rows"] if row["available"]]
    check(
        live == ["numpy", "numpy"] and all(row["reason"] for row in benched["rows"] if not row["available"]),
        "kvports bench times numpy and says why every other row is unavailable",
    )
    batched = json.loads(run("bench", "--json", "--requests", "2"))
    check(
        [(row["framework"], row["available"]) for row in batched["rows"]][:2] == [("torch", False), ("torch", False)]
        and [row["same_tokens"] for row in batched["rows"] if row["available"]] == [2, 2],
        "kvports bench --requests batches with numpy and says why torch and jax cannot",
    )


if __name__ == "__main__":
    main()
