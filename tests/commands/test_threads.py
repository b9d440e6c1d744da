"""`--threads`: one thread count for every framework, reaching each framework's own pools, and
shown in generate's JSON and compare's title. (A count out of range: tests/bad_input/test_sizes.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.commands import run_cli
from tests.helpers.ports import port_or_skip


@pytest.fixture
def no_threads_change(monkeypatch):
    """An in-process command asked for --threads leaves the test process's threads as they were."""
    from kvports import threads

    monkeypatch.setattr(threads, "use_threads", lambda count: None)
    for module in ("kvports.commands.generate_command", "kvports.commands.compare"):
        monkeypatch.setattr(f"{module}.use_threads", lambda count: None)


# What each framework reports as its thread count, after `kvports generate --threads 2` in the same process.
REPORTED = {
    "torch": "import torch; print(torch.get_num_threads(), torch.get_num_interop_threads())",
    # the threads its products are split across (numpy_impl/fast/cores.py: none, by default), its prompt
    # attention's (every thread given; 0: the lesson's) and its BLAS's
    "numpy": "import threadpoolctl; from kvports.numpy_impl.fast.cores import attention_threads, split_threads; "
    "print(split_threads(), attention_threads(), *sorted({p['num_threads'] for p in threadpoolctl.threadpool_info() "
    "if p['user_api'] == 'blas'}))",
    "jax": "import os; print(os.environ['NPROC'], os.environ['NPROC'])",  # read by XLA's CPU client as it starts
}


EXPECTED = {"torch": "2 2", "numpy": "1 2 2", "jax": "2 2"}


def test_threads_reach_the_framework(port):
    name = port.NAME
    script = (
        "from kvports.cli import main; "
        f"assert main(['generate', '--framework', '{name}', '--mode', 'cached', '--new-tokens', '2', '--threads', '2'])"
        f" == 0; {REPORTED[name]}"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == EXPECTED[name]


def test_one_thread_gives_numpy_its_prompt_attention_on_that_thread():
    """--threads 1: no product split, the prompt attention's causal blocks on the one thread, OpenBLAS at 1."""
    port_or_skip("numpy")
    script = (
        "from kvports.cli import main; "
        "assert main(['generate', '--framework', 'numpy', '--mode', 'cached', '--new-tokens', '2', '--threads', '1'])"
        f" == 0; {REPORTED['numpy']}"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "1 1 1"


def test_generate_json_and_compare_title_show_the_thread_count(capsys, no_threads_change):
    code, out, err = run_cli(capsys, "generate", "--framework", "numpy", "--mode", "cached", "--threads", "1", "--json")
    assert code == 0, err
    assert json.loads(out)["threads"] == 1
    code, out, err = run_cli(capsys, "compare", "--frameworks", "numpy", "--repeats", "1", "--threads", "3")
    assert code == 0, err
    assert "3 threads;" in " ".join(out.split())
