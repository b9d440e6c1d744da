"""Fixtures shared by every test (the ports, by name, and the seed's model) and the session's
settings. Helpers and constants live in tests/helpers/ (a module per role); nothing imports this file."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

# Set before anything imports numpy, torch or jax; a user's own settings win.
# One thread per BLAS/OpenMP pool: the models here are tiny, and on two cores shared with
# other work, pools whose threads spin while they wait for each other made the torch and
# NumPy tests ten times slower.
for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")
# JAX keeps what it compiles on disk, so a second run of the suite skips the compiles (most
# of the JAX tests' time on a first run).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".pytest_cache/jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# XLA's CPU compiler at its cheapest: the suite's programs are tiny and each runs a few times,
# so compiling them is most of its time. Without LLVM's optimisation passes (-O0), with the
# older fusion emitters (the MLIR ones cost more to compile) and one LLVM module per program,
# the suite's JAX programs compile ~3x faster (CPU seconds) and run at most ~2x slower.
# Every result is unchanged to the tests' bounds (float64 tokens and logits against torch's
# included). Subprocesses inherit it (tests.helpers.parallel.tensor_parallel_subprocess adds to it).
FAST_COMPILE = {
    "xla_backend_optimization_level": "0",
    "xla_cpu_use_fusion_emitters": "false",
    "xla_cpu_parallel_codegen_split_count": "1",
}


def _flags_jaxlib_knows(flags: dict[str, str]) -> str:
    """The flags whose names the installed jaxlib's library holds: XLA aborts the process on a
    flag it does not know, and a jaxlib that dropped one must cost speed, not the suite."""
    import importlib.util
    import mmap

    spec = importlib.util.find_spec("jaxlib")  # finds it without importing it
    if spec is None or not spec.submodule_search_locations:
        return ""
    libraries = sorted(Path(spec.submodule_search_locations[0]).glob("*.so"), key=lambda p: p.stat().st_size)
    if not libraries:
        return ""
    try:
        with open(libraries[-1], "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as library:
            return " ".join(f"--{name}={value}" for name, value in flags.items() if library.find(name.encode()) >= 0)
    except (OSError, ValueError):  # unreadable: no flags, the default compiler
        return ""


if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = _flags_jaxlib_knows(FAST_COMPILE)


def _test_home() -> Path:
    """$KVPORTS_HOME for the session: a folder of the checkout's, so no test writes the load cache or
    JAX's into the user's; the fetched real model (if any) is linked into it, so the tests that need it find it."""
    from kvports.hub import MODELS, home

    user, tests = home(), Path(__file__).resolve().parent.parent / ".pytest_cache" / "kvports-home"
    tests.mkdir(parents=True, exist_ok=True)
    for model in MODELS.values():
        link = tests / model.filename
        if (user / model.filename).is_file() and not link.exists() and user != tests:
            link.unlink(missing_ok=True)  # a link left dangling
            with contextlib.suppress(FileExistsError):  # another worker linked it first
                link.symlink_to(user / model.filename)
    return tests


os.environ["KVPORTS_HOME"] = str(_test_home())

import pytest  # noqa: E402

from kvports import registry  # noqa: E402
from kvports import threads as process_threads  # noqa: E402
from kvports.formats.weights import load_weights  # noqa: E402
from kvports.registry import PORTS  # noqa: E402
from tests.helpers.gguf_files import write_gguf  # noqa: E402
from tests.helpers.ports import port_or_skip  # noqa: E402


@pytest.fixture(autouse=True)
def suite_threads():
    """A command run in this process with --threads sets the process's counts (use_threads: BLAS,
    torch, NumPy's prompt attention, every port's row loop) for good, as a command's process should;
    here the next test on the worker must run as it would alone, so the suite's counts (the variables
    above) come back."""
    variables = {name: os.environ.get(name) for name in process_threads.THREAD_VARIABLES}
    yield
    if not process_threads.REQUESTED:
        return
    for name, value in variables.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    process_threads.REQUESTED.clear()
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=int(os.environ["OPENBLAS_NUM_THREADS"]))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if process_threads.TORCH_PORT in sys.modules:
        from kvports.torch_impl.fast.row_loop import install_row_products

        install_row_products(None)
    if process_threads.JAX_PORT in sys.modules:
        from kvports.jax_impl.fast.row_loop import install_row_products as install_jax_loop

        install_jax_loop(None)
    if process_threads.NUMPY_PORT in sys.modules:
        from kvports.numpy_impl.fast.row_loop import use_numpy_threads

        use_numpy_threads(None)


@pytest.fixture(params=PORTS)
def port(request):
    """Each port's NumPy-in/NumPy-out module (torch_impl.port, jax_impl.port, numpy_impl.port)."""
    return port_or_skip(request.param)


@pytest.fixture
def reference():
    return port_or_skip("torch")


@pytest.fixture(scope="session")
def seed_weights():
    return load_weights()


@pytest.fixture
def no_port_may_load(monkeypatch):
    """A bad input must be refused before any framework is imported or run."""

    def refuse(name):
        raise AssertionError(f"port {name} was loaded before the input was checked")

    monkeypatch.setattr(registry, "load_port", refuse)
    monkeypatch.setattr(registry, "available_port", refuse)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny GGUF file with a byte-level tokenizer and a ChatML template: text and chats in any command."""
    return write_gguf(tmp_path_factory.mktemp("chat") / "tiny.gguf", "F32")


# The slowest files first, by CPU seconds on a fresh clone (a JAX compilation cache to fill), by
# their paths under tests/. `make test` hands whole files to its workers in collection order
# (--dist loadfile --no-loadscope-reorder; xdist's default order is by test count, which put these
# last), so the longest start first and the short ones fill in behind them, instead of one worker
# finishing a long file alone while the other idles. A file not named here keeps its place after
# them; a name here that is no file fails tests/structure/test_suite_order.py.
SLOWEST_FILES = (
    "test_tensor_parallel.py",  # its fixture waits on a subprocess compiling every split
    "test_tensor_parallel_torch.py",  # two ranks spawned per model, each importing torch
    "test_smollm2.py",
    "bench/test_bench.py",
    "test_accepted.py",  # every accepted format through three load paths, batch and serve
    "test_generation.py",
    "batching/test_batching.py",
    "test_speculative.py",
    "test_sampling.py",
    "test_docs.py",  # every command output pasted in the docs, run again
    "test_hf_agreement.py",
    "test_loops.py",
    "test_quant.py",
    "test_check.py",
    "checker/test_isolation.py",  # a child process per check, each importing the checker
    "checker/test_verdict.py",  # a hostile implementation per test, each in a checker child
    "test_jax_compilation.py",
    "test_random_configs.py",
    "commands/test_compare_figures.py",
    "bad_input/test_command_line.py",  # a subprocess per command for a closed pipe
    "test_pitfalls.py",
    "commands/test_threads.py",  # a subprocess per port, each importing its framework
    "test_gpu.py",  # make gpu-check end to end on the CPU: a subprocess per kvports command it runs
)
TESTS = Path(__file__).resolve().parent
_RANK = {name: index for index, name in enumerate(SLOWEST_FILES)}


def file_rank(path: Path) -> int:
    """Where a test file comes in the order: its place in SLOWEST_FILES, or after all of them."""
    try:
        return _RANK.get(path.resolve().relative_to(TESTS).as_posix(), len(_RANK))
    except ValueError:  # a file outside tests/
        return len(_RANK)


@pytest.hookimpl(trylast=True)  # after pytest's own reordering by fixture, which it keeps within each file
def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: file_rank(item.path))
