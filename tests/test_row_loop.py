"""Each port's float32 decode products as a loop over the weight's rows (numpy_impl/fast/row_loop.py,
compiled by numba; torch_impl/fast/row_loop.py, C++ built by torch's cpp_extension; jax_impl/fast/row_loop.py,
C++ run as an XLA custom call): the BLAS's (or XLA's dot's) products
to float32 rounding at every shape, the same bits at every thread count, the product in place before
for everything else, installed by --threads with every float32 weight laid out by rows, and the BLAS's
products where the loop cannot be built."""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from tests.helpers.models import LONG, TINY_FAMILIES, llama_like, random_prompts, random_weights
from tests.helpers.ports import port_or_skip

# SmolLM2-135M's proj, qkv, gate/up and down (out, in), and rows no thread count divides
SHAPES = [(576, 576), (960, 576), (3072, 576), (576, 1536), (4999, 576), (7, 5)]
LOOP_PORTS = ["numpy", "torch", "jax"]  # every port has a row loop


@dataclass
class Loop:
    """One port's row loop, called with NumPy arrays: `install(threads)` returns the port's product
    (x, weight, bias=None) as its model calls it, `plain` is the product in place before the loop."""

    name: str
    module: ModuleType  # the port's fast/row_loop.py
    install: Callable[[int], Callable[..., np.ndarray]]
    plain: Callable[..., np.ndarray]
    route: str  # linear_route at float32 while installed
    longest: int  # the most rows of input the port runs off the lesson's product


def numpy_loop() -> Loop:
    pytest.importorskip("numba")
    from kvports.numpy_impl import functional
    from kvports.numpy_impl.fast import row_loop
    from kvports.numpy_impl.fast.cores import PLAIN_LINEAR

    def install(threads: int) -> Callable[..., np.ndarray]:
        assert row_loop.install_row_products(threads) is not None
        return functional.linear

    return Loop("numpy", row_loop, install, PLAIN_LINEAR, "numba+blas", row_loop.FEW_ROWS)


def torch_loop() -> Loop:
    import torch

    from kvports.torch_impl.fast import cores, onednn, row_loop

    def through(linear: Callable[..., Any]) -> Callable[..., np.ndarray]:
        def product(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
            with torch.inference_mode():
                given = None if bias is None else torch.from_numpy(bias)
                return linear(torch.from_numpy(x), torch.from_numpy(weight), given).numpy()

        return product

    def install(threads: int) -> Callable[..., np.ndarray]:
        assert row_loop.install_row_products(threads) is not None
        return through(onednn.linear)

    return Loop("torch", row_loop, install, through(cores.linear), "loop+mkl", row_loop.LOOP_ROWS)


def jax_loop() -> Loop:
    import jax
    import jax.numpy as jnp

    from kvports.jax_impl import functional
    from kvports.jax_impl.fast import row_loop

    def through(linear: Callable[..., Any]) -> Callable[..., np.ndarray]:
        def product(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
            with jax.enable_x64(True):  # the port's calls run so (port.exact): float64 stays float64
                given = None if bias is None else jnp.asarray(bias)
                return np.asarray(linear(jnp.asarray(x), jnp.asarray(weight), given))

        return product

    def install(threads: int) -> Callable[..., np.ndarray]:
        assert row_loop.install_row_products(threads) is not None
        return through(row_loop.linear)

    return Loop("jax", row_loop, install, through(functional.linear), "loop+xla", row_loop.LOOP_ROWS)


LOOPS = {"numpy": numpy_loop, "torch": torch_loop, "jax": jax_loop}


@pytest.fixture(params=LOOP_PORTS)
def loop(request):
    """The port's loop, built (numba, or a C++ compiler, required), and the products in place before put back after."""
    port_or_skip(request.param)
    made = LOOPS[request.param]()
    if made.module.compiled_loop() is None:
        pytest.skip(f"{request.param}'s row loop was not built here: {getattr(made.module, 'FAILED', [''])[:1]}")
    yield made
    made.module.install_row_products(None)


@pytest.mark.parametrize("shape", SHAPES)
def test_the_loop_gives_the_blas_products_to_float32_rounding_at_every_shape(loop, shape):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal(shape, dtype=np.float32)  # [out, in], C order: the loop's layout
    x = rng.standard_normal((1, 1, shape[1]), dtype=np.float32)  # [B, T, in]: a decode step's one row
    expected = loop.plain(x, weight)  # [1, 1, out]
    got = loop.install(2)(x, weight)
    assert got.shape == expected.shape and got.dtype == np.float32
    scale = np.sqrt(shape[1])  # a sum of `in` unit products: its rounding grows with its length
    np.testing.assert_allclose(got, expected, rtol=0, atol=4e-6 * scale)


@pytest.mark.parametrize("shape", [(4999, 576), (7, 5)])
def test_every_thread_count_gives_the_same_bits(loop, shape):
    rng = np.random.default_rng(1)
    weight = rng.standard_normal(shape, dtype=np.float32)
    x = rng.standard_normal((1, shape[1]), dtype=np.float32)
    results = [loop.install(threads)(x, weight) for threads in (1, 2, 3, 8)]
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])


def test_a_bias_is_added_after_the_loop(loop):
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((96, 64), dtype=np.float32)
    bias = rng.standard_normal(96, dtype=np.float32)
    x = rng.standard_normal((1, 64), dtype=np.float32)
    np.testing.assert_allclose(loop.install(2)(x, weight, bias), loop.plain(x, weight, bias), atol=1e-5)


@pytest.mark.parametrize(
    "case", ["float64", "a prompt longer than the loop takes", "weight stored transposed", "float64 weight"]
)
def test_float64_long_prompts_and_transposed_weights_run_the_product_in_place_before(loop, case):
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((96, 64), dtype=np.float32)  # [out, in]
    x = rng.standard_normal((1, 64), dtype=np.float32)
    if case == "float64":
        x, weight = x.astype(np.float64), weight.astype(np.float64)
    elif case == "a prompt longer than the loop takes":
        x = rng.standard_normal((1, loop.longest + 1, 64), dtype=np.float32)  # [1, T, in]
    elif case == "weight stored transposed":
        weight = np.asfortranarray(weight)  # weight.T contiguous: the BLAS's order for this shape
    else:
        weight = weight.astype(np.float64)
    if loop.name == "jax" and case == "weight stored transposed":
        pytest.skip("a JAX array has no strides: every float32 weight reaches the loop by rows")
    product = loop.install(2)
    if loop.name == "torch" and case == "float64 weight":  # torch multiplies no mixed dtypes, in the loop or not
        for linear in (product, loop.plain):
            with pytest.raises(RuntimeError, match="dtype"):
                linear(x, weight)
        return
    np.testing.assert_array_equal(product(x, weight), loop.plain(x, weight))


# [B, T, in]: a batch's decode step, short prompts
@pytest.mark.parametrize("shape", [(2, 1, 576), (1, 5, 576), (3, 1, 1536), (1, 8, 576)])
def test_up_to_loop_rows_each_row_gets_its_own_one_row_products_bits(loop, shape):
    rng = np.random.default_rng(6)
    weight = rng.standard_normal((960, shape[-1]), dtype=np.float32)  # [out, in]
    x = rng.standard_normal(shape, dtype=np.float32)
    assert shape[0] * shape[1] <= loop.module.LOOP_ROWS
    product = loop.install(2)
    got = product(x, weight)  # [B, T, out]
    alone = np.stack([product(row[None], weight)[0] for row in x.reshape(-1, shape[-1])])  # [B T, out], a row at a time
    np.testing.assert_array_equal(got.reshape(-1, weight.shape[0]), alone)


@pytest.mark.parametrize("rows", [9, 64])
def test_a_few_rows_give_openblas_products_to_float32_rounding_in_row_order(rows):
    # NumPy only: torch runs more than LOOP_ROWS rows as MKL's product. Which operand order OpenBLAS gets
    # is a matter of speed (docs/BENCH.md); the values stay its products.
    port_or_skip("numpy")
    loop = numpy_loop()
    rng = np.random.default_rng(7)
    weight = rng.standard_normal((960, 576), dtype=np.float32)  # [out, in]
    bias = rng.standard_normal(960, dtype=np.float32)
    x = rng.standard_normal((1, rows, 576), dtype=np.float32)  # [1, T, in]: a short prompt
    assert loop.module.LOOP_ROWS < rows <= loop.module.FEW_ROWS
    try:
        got = loop.install(2)(x, weight, bias)
    finally:
        loop.module.install_row_products(None)
    expected = loop.plain(x, weight, bias)  # [1, T, out]
    assert got.shape == expected.shape and got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_allclose(got, expected, rtol=0, atol=4e-6 * np.sqrt(576))


def test_an_overflow_still_reaches_the_output(loop):
    # an overflowing step must reach the logits as inf or nan (the ports check for it), never as a finite number
    weight = np.ones((64, 32), dtype=np.float32)
    weight[5, 3] = np.inf
    weight[9, 0] = np.nan
    x = np.full((1, 32), 3e37, dtype=np.float32)  # every other row's sum overflows float32 too
    got = loop.install(2)(x, weight)
    assert not np.isfinite(got).any()
    assert np.isnan(got[0, 9]) and np.isposinf(got[0, 0])


def test_a_call_from_another_thread_runs_on_the_processs_count():
    port_or_skip("numpy")
    loop = numpy_loop()
    import numba

    product = loop.install(1)
    weight = np.ones((64, 32), dtype=np.float32)
    seen: list[int] = []

    def call() -> None:  # numba's count is per thread: a server's engine thread starts at numba's default
        product(np.ones((1, 32), dtype=np.float32), weight)
        seen.append(numba.get_num_threads())

    worker = threading.Thread(target=call)
    try:
        worker.start()
        worker.join()
    finally:
        loop.module.install_row_products(None)
    assert seen == [1]


def loaded_matrices(port: Any, config: Any, tensors: dict, dtype: str) -> list[tuple[tuple[int, ...], bool]]:
    """Each weight matrix of the port's loaded model: its (out, in) shape, and whether its rows are contiguous."""
    model = port.load_model(config, tensors, dtype)
    if port.NAME == "torch":
        return [(tuple(p.shape), p.is_contiguous()) for p in model.parameters() if p.dim() == 2]
    if port.NAME == "jax":  # nnx.Linear keeps its kernel [in, out]; the layouts' modules a weight [out, in]
        from flax import nnx

        matrices = []
        for _, module in nnx.iter_modules(model):
            if isinstance(module, nnx.Linear):
                matrices.append((tuple(module.kernel.shape[::-1]), False))
            elif isinstance(getattr(module, "weight", None), nnx.Param) and module.weight.ndim == 2:
                matrices.append((tuple(module.weight.shape), True))
            elif isinstance(module, nnx.Embed):
                matrices.append((tuple(module.embedding.shape), True))
        return matrices
    arrays = [getattr(owner, attr) for _, owner, attr in model.named_parameters()]
    return [(array.shape, array.flags.c_contiguous) for array in arrays if array.ndim == 2]


def test_use_threads_installs_it_and_lays_out_float32_weights_by_rows(loop):
    port = port_or_skip(loop.name)
    from kvports.shared.shapes import stored_transposed
    from kvports.threads import use_threads

    config = llama_like(vocab_size=256, d_model=64, n_heads=4, n_layers=1, max_seq_len=32)
    tensors = random_weights(config)
    use_threads(2)  # the suite's fixture (conftest.suite_threads) puts the counts back after
    assert loop.module.row_threads() == 2
    assert port.linear_route("float32", "none", "cpu") == loop.route
    assert port.linear_route("float64", "none", "cpu") == loop.route.split("+")[1]
    float32 = loaded_matrices(port, config, tensors, "float32")
    float64 = loaded_matrices(port, config, tensors, "float64")
    assert float32 and all(by_rows for _, by_rows in float32)
    assert any(stored_transposed(shape) for shape, _ in float32)  # a matrix the BLAS's layout would transpose
    loop.module.install_row_products(None)
    assert float64 == loaded_matrices(port, config, tensors, "float64")  # float64: laid out as without the loop
    assert loaded_matrices(port, config, tensors, "float32") != float32  # and float32 by rows for the loop alone


def test_a_generation_keeps_its_tokens_and_every_thread_count_its_logits(loop):
    port = port_or_skip(loop.name)
    config = llama_like(vocab_size=256, d_model=64, n_heads=4, n_layers=2, max_seq_len=48)
    tensors = random_weights(config, seed=5)
    prompt = random_prompts(config.vocab_size, batch=1, length=6, seed=5)  # [1, 6]
    lesson = port.generate(port.load_model(config, tensors, "float32"), prompt, 12, "cached", True)
    runs = []
    for threads in (1, 2):
        loop.module.install_row_products(threads)
        model = port.load_model(config, tensors, "float32")  # laid out by rows while installed
        runs.append(port.generate(model, prompt, 12, "cached", True))
    for tokens, logits in runs:
        np.testing.assert_array_equal(tokens, lesson[0])
        np.testing.assert_allclose(logits, lesson[1], rtol=0, atol=1e-4)
    np.testing.assert_array_equal(runs[1][1], runs[0][1])  # the same bits at 1 and 2 threads


def test_without_numba_openblas_runs_every_product(monkeypatch):
    numpy_port = port_or_skip("numpy")
    from kvports.numpy_impl import functional
    from kvports.numpy_impl.fast import row_loop
    from kvports.numpy_impl.fast.cores import PLAIN_LINEAR

    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` raises ImportError
    monkeypatch.setattr(row_loop, "KERNELS", [])
    try:
        assert row_loop.install_row_products(2) is None
        assert functional.linear is PLAIN_LINEAR
        assert row_loop.row_threads() == 0
        assert numpy_port.linear_route("float32", "none", "cpu") == "blas"
    finally:
        row_loop.install_row_products(None)


def test_without_a_build_mkl_runs_every_product(monkeypatch):
    torch_port = port_or_skip("torch")
    from kvports.torch_impl.fast import row_loop

    monkeypatch.setitem(
        sys.modules, "torch.utils.cpp_extension", None
    )  # no compiler, ninja or setuptools: the import fails
    monkeypatch.setattr(row_loop, "KERNELS", [])
    monkeypatch.setattr(row_loop, "FAILED", [])
    try:
        assert row_loop.install_row_products(2) is None
        assert row_loop.row_threads() == 0
        assert row_loop.FAILED and "torch.utils.cpp_extension" in row_loop.FAILED[0]  # why, kept for the skip's reason
        assert torch_port.linear_route("float32", "none", "cpu") == "mkl"
    finally:
        row_loop.install_row_products(None)


def test_without_a_compiler_xlas_dot_runs_every_product(monkeypatch, tmp_path):
    jax_port = port_or_skip("jax")
    from kvports.jax_impl.fast import row_loop

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(row_loop.EXTENSIONS_VARIABLE, str(tmp_path / "extensions"))  # no earlier build to find
    monkeypatch.setattr(row_loop, "KERNELS", [])
    monkeypatch.setattr(row_loop, "FAILED", [])
    try:
        assert row_loop.install_row_products(2) is None
        assert row_loop.row_threads() == 0
        assert row_loop.FAILED and "no-such-compiler" in row_loop.FAILED[0]  # why, kept for the skip's reason
        assert jax_port.linear_route("float32", "none", "cpu") == "xla"
    finally:
        row_loop.install_row_products(None)
    assert not list((tmp_path / "extensions").glob("*"))  # no half-built library left behind


def x86_only() -> None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("AVX2 is an x86-64 instruction set")


def test_an_avx2_only_cpu_gets_numpys_loop_compiled_for_avx2(tmp_path):
    # KVPORTS_CPU=avx2 stands for an AVX2 machine (shared/cpu.py): the loop must not use AVX-512's registers there.
    port_or_skip("numpy")
    pytest.importorskip("numba")
    x86_only()
    script = (
        "from kvports.numpy_impl.fast import row_loop\n"
        "loop = row_loop.compiled_loop()\n"
        "import numba\n"
        "print(numba.config.CPU_NAME)\n"
        "print('zmm' in loop.inspect_asm(loop.signatures[0]))\n"
    )
    env = {**os.environ, "KVPORTS_CPU": "avx2", "NUMBA_CACHE_DIR": str(tmp_path)}
    env.pop("NUMBA_CPU_NAME", None)
    env.pop("NUMBA_CPU_FEATURES", None)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["haswell", "False"]


# each C++ loop's build directory variable, and where its AVX2 build lands under it
CPP_BUILDS = {
    "torch": ("TORCH_EXTENSIONS_DIR", "kvports_row_loop_haswell/*.so"),
    "jax": ("KVPORTS_EXTENSIONS_DIR", "kvports_jax_row_loop_haswell_*.so"),
}


@pytest.mark.parametrize("name", list(CPP_BUILDS))
def test_an_avx2_only_cpu_gets_the_cpp_loop_built_for_avx2(name, tmp_path, monkeypatch):
    port_or_skip(name)
    x86_only()
    row_loop = LOOPS[name]().module

    if row_loop.compiled_loop() is None:
        pytest.skip(f"{name}'s row loop was not built here: {row_loop.FAILED[:1]}")
    monkeypatch.setenv("KVPORTS_CPU", "avx2")
    assert row_loop.build_target() == ("haswell", ["-march=haswell"])
    monkeypatch.delenv("KVPORTS_CPU")
    assert row_loop.build_target()[0].startswith("native_")
    variable, built = CPP_BUILDS[name]
    script = f"from kvports.{name}_impl.fast import row_loop\nassert row_loop.compiled_loop(), row_loop.FAILED\n"
    env = {**os.environ, "KVPORTS_CPU": "avx2", variable: str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    [library] = tmp_path.glob(built)
    assembly = subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True, timeout=60).stdout
    assert "ymm" in assembly and "zmm" not in assembly


def test_huge_page_copies_equal_their_arrays_each_on_a_page_of_one_mapping():
    from kvports.shared.pages import ALIGN, HUGE_PAGE, in_huge_pages

    rng = np.random.default_rng(8)
    arrays = {"a": rng.standard_normal((960, 576), dtype=np.float32), "b": np.arange(7, dtype=np.int64)}
    arrays["c"] = np.asfortranarray(rng.standard_normal((5, 3)))  # float64, Fortran order: copied in C order
    copies = in_huge_pages(arrays)
    assert list(copies) == list(arrays)
    for name, array in arrays.items():
        np.testing.assert_array_equal(copies[name], array)
        assert copies[name].dtype == array.dtype and copies[name].flags.c_contiguous
        assert copies[name].ctypes.data % ALIGN == 0
    assert copies["a"].ctypes.data % HUGE_PAGE == 0  # the first starts on a 2 MB boundary
    assert copies["a"].base is copies["b"].base is copies["c"].base  # one mapping holds them all


def matrix_addresses(port: Any, model: Any) -> set[int]:
    """Where each float32 weight matrix of a loaded model starts in memory."""
    if port.NAME == "torch":
        return {p.data_ptr() for p in model.parameters() if p.dim() == 2 and p.dtype.itemsize == 4}
    if port.NAME == "jax":
        import jax
        from flax import nnx

        leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
        return {a.unsafe_buffer_pointer() for a in leaves if a.ndim == 2 and a.dtype.itemsize == 4}
    arrays = [getattr(owner, attr) for _, owner, attr in model.named_parameters()]
    return {a.ctypes.data for a in arrays if a.ndim == 2 and a.dtype.itemsize == 4}


PAGES_MODULES = {  # where each port calls shared.pages.in_huge_pages
    "numpy": "kvports.numpy_impl.fast.layout",
    "torch": "kvports.torch_impl.fast.onednn",
    "jax": "kvports.jax_impl.fast.row_loop",
}


def test_a_loop_models_weights_are_huge_page_copies_one_of_a_tied_head(loop, monkeypatch):
    import importlib

    from kvports.shared.pages import in_huge_pages

    port = port_or_skip(loop.name)
    made: dict[str, np.ndarray] = {}

    def recorded(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        made.update(in_huge_pages(arrays))
        return made

    monkeypatch.setattr(importlib.import_module(PAGES_MODULES[loop.name]), "in_huge_pages", recorded)
    loop.install(2)
    config = llama_like(vocab_size=256, d_model=64, n_heads=4, n_layers=2, max_seq_len=32, tie_embeddings=True)
    model = port.load_model(config, random_weights(config), "float32")
    # qkv, proj, ffn.0, ffn.2 a layer, and the tied embedding, which is the head's weight: one copy each
    assert len(made) == 4 * config.n_layers + 1
    assert matrix_addresses(port, model) == {copy.ctypes.data for copy in made.values()}


@pytest.fixture
def torch_norms():
    """torch's loop installed at 2 threads (its library carries the norm): the row_loop module."""
    port_or_skip("torch")
    from kvports.torch_impl.fast import row_loop

    if row_loop.install_row_products(2) is None:
        pytest.skip(f"torch's row loop was not built here: {row_loop.FAILED[:1]}")
    yield row_loop
    row_loop.install_row_products(None)


def lesson_and_loop_norm(width: int, seed: int) -> tuple[Any, Any]:
    """model.py's RMSNorm of `width` with random weights, and the same module's twin as a LoopNorm. Its
    eps, 0.01, moves a unit input's norm by ~0.5%: a norm that dropped it would show."""
    import copy

    import torch

    from kvports.torch_impl.fast.row_loop import LoopNorm
    from kvports.torch_impl.model import RMSNorm

    lesson = RMSNorm(width, 0.01)
    with torch.no_grad():
        lesson.weight.copy_(torch.from_numpy(np.random.default_rng(seed).standard_normal(width, dtype=np.float32)))
    twin = copy.deepcopy(lesson)
    twin.__class__ = LoopNorm
    return lesson, twin


@pytest.mark.parametrize("shape", [(1, 1, 576), (1, 8, 576), (3, 1, 64), (1, 1, 7)])
def test_the_loop_norm_gives_the_lessons_rmsnorm_to_float32_rounding(torch_norms, shape):
    import torch

    lesson, twin = lesson_and_loop_norm(shape[-1], seed=7)
    x = torch.from_numpy(np.random.default_rng(8).standard_normal(shape, dtype=np.float32))  # [B, T, D]
    calls = []
    kernel = torch_norms.INSTALLED[0].norm
    torch_norms.INSTALLED[0].norm = lambda *args: calls.append(args) or kernel(*args)
    with torch.inference_mode():
        expected, got = lesson(x), twin(x)
    assert calls and got.shape == expected.shape and got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["float64", "9 rows", "not contiguous", "not installed", "grad"])
def test_the_loop_norm_runs_the_lessons_own_norm_for_everything_else(torch_norms, case):
    import torch

    lesson, twin = lesson_and_loop_norm(64, seed=9)
    rows, width = (9 if case == "9 rows" else 2), (128 if case == "not contiguous" else 64)
    x = torch.from_numpy(np.random.default_rng(10).standard_normal((1, rows, width)))
    x = x.double() if case == "float64" else x.float()  # [B, T, D]
    if case == "float64":
        lesson.double(), twin.double()
    if case == "not contiguous":
        x = x[..., ::2]  # [B, T, 64]: every other element of wider rows
    if case == "not installed":
        torch_norms.install_row_products(None)
    calls: list[tuple[Any, ...]] = []
    if torch_norms.INSTALLED:
        torch_norms.INSTALLED[0].norm = lambda *args: calls.append(args)
    with torch.inference_mode(case != "grad"):
        expected, got = lesson(x), twin(x)
    assert not calls  # the C++ norm was never asked
    np.testing.assert_array_equal(got.detach().numpy(), expected.detach().numpy())


def test_a_loop_models_float32_norms_are_loop_norms_and_float64s_the_lessons(torch_norms):
    torch_port = port_or_skip("torch")
    from kvports.torch_impl.model import RMSNorm

    config = llama_like(vocab_size=256, d_model=64, n_heads=4, n_layers=2, max_seq_len=32)
    tensors = random_weights(config)

    def norms(dtype: str) -> list[str]:
        model = torch_port.load_model(config, tensors, dtype)
        return [type(module).__name__ for module in model.modules() if isinstance(module, RMSNorm)]

    assert norms("float32") == ["LoopNorm"] * (2 * config.n_layers + 1)  # ln1 and ln2 a layer, and the last
    assert norms("float64") == ["RMSNorm"] * (2 * config.n_layers + 1)
    torch_norms.install_row_products(None)
    assert norms("float32") == ["RMSNorm"] * (2 * config.n_layers + 1)


def decode_steps(
    config: Any, dtype: str, batch: int, steps: int, pad: Any = None, grad: bool = False, prompt_len: int = 5
) -> Any:
    """A model loaded at `dtype` (its blocks made LoopBlocks whatever the load made them) decoding `steps`
    tokens after a prompt of `prompt_len`: each step run twice from the same cache, by LoopBlock and by
    model.py's Block. Yields (LoopBlock's logits [B, 1, V], Block's, the caches after each)."""
    import torch

    from kvports.torch_impl.fast.row_loop import LoopBlock
    from kvports.torch_impl.model import Block, init_cache

    torch_port = port_or_skip("torch")
    model = torch_port.load_model(config, random_weights(config), dtype)
    prompt = torch.from_numpy(random_prompts(config.vocab_size, batch, prompt_len))  # [B, P]
    with torch.enable_grad() if grad else torch.inference_mode():
        cache = init_cache(config, batch, prompt_len + steps, model.emb.weight.dtype)
        logits, cache = model(prompt, cache, pad, logits_to_keep=1)
        token = logits[:, -1:].argmax(-1)  # [B, 1]
        for _ in range(steps):
            twin = dataclasses.replace(
                cache, keys=cache.keys.clone(), values=cache.values.clone(), slot_positions=cache.slot_positions.clone()
            )
            for block in model.blocks:
                block.__class__ = Block
            expected, twin = model(token, twin, pad)  # [B, 1, V]
            for block in model.blocks:
                block.__class__ = LoopBlock
            got, cache = model(token, cache, pad)  # [B, 1, V]
            yield got, expected, cache, twin
            token = got[:, -1:].argmax(-1)  # [B, 1]


DECODE_FAMILIES = {
    "gqa": TINY_FAMILIES["llama"],
    "mqa, own scale": dataclasses.replace(TINY_FAMILIES["llama"], n_kv_heads=1, attn_scale=0.3),
    "window ring": TINY_FAMILIES["mistral"],  # a ring of 4 slots, written round more than once
    "learned positions, biases": TINY_FAMILIES["gpt2"],
}


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("family", list(DECODE_FAMILIES))
def test_the_loop_blocks_decode_attention_gives_the_lessons_to_float32_rounding(torch_norms, family, batch):
    calls = []
    kernel = torch_norms.INSTALLED[0].attention
    torch_norms.INSTALLED[0].attention = lambda *args: calls.append(args) or kernel(*args)
    config = DECODE_FAMILIES[family]
    for step, (got, expected, cache, twin) in enumerate(decode_steps(config, "float32", batch, steps=6)):
        assert len(calls) == config.n_layers * (step + 1)  # the C++ call ran in every layer of every step
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)
        # the new key and value written at their slot, the key rotated as the lesson rotates it (a later
        # layer's input differs by the earlier layers' rounding)
        np.testing.assert_allclose(cache.keys.numpy(), twin.keys.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(cache.values.numpy(), twin.values.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(cache.slot_positions.numpy(), twin.slot_positions.numpy())
        assert cache.length == twin.length


def test_a_long_caches_heads_dealt_across_the_threads_give_the_lessons_attention(torch_norms):
    threads = []
    kernel = torch_norms.INSTALLED[0].attention
    torch_norms.INSTALLED[0].attention = lambda *args: threads.append(args[-1]) or kernel(*args)
    # 4 heads over 2100 slots: past row_loop.cpp's 8192 head-slots, where its heads go to 2 threads
    for got, expected, cache, twin in decode_steps(LONG, "float32", 1, steps=2, prompt_len=2100):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(cache.keys.numpy(), twin.keys.numpy(), rtol=1e-5, atol=1e-6)
    assert threads and set(threads) == {2}


@pytest.mark.parametrize("case", ["padded", "qk_norm", "float64", "not installed", "grad"])
def test_the_loop_blocks_run_the_lessons_attention_for_everything_else(torch_norms, case):
    import torch

    calls: list[tuple[Any, ...]] = []
    torch_norms.INSTALLED[0].attention = lambda *args: calls.append(args)
    config = TINY_FAMILIES["qwen3" if case == "qk_norm" else "llama"]
    pad = torch.tensor([0, 2]) if case == "padded" else None  # the second row's first two tokens are padding
    if case == "not installed":
        torch_norms.install_row_products(None)
    dtype = "float64" if case == "float64" else "float32"
    got, expected, _, _ = next(decode_steps(config, dtype, 2, steps=2, pad=pad, grad=case == "grad"))
    assert not calls  # the C++ attention was never asked (a prompt's prefill never asks it either)
    np.testing.assert_array_equal(got.detach().numpy(), expected.detach().numpy())


def test_a_loop_models_float32_blocks_are_loop_blocks_and_float64s_the_lessons(torch_norms):
    torch_port = port_or_skip("torch")
    config = TINY_FAMILIES["llama"]
    tensors = random_weights(config)

    def blocks(dtype: str) -> list[str]:
        return [type(block).__name__ for block in torch_port.load_model(config, tensors, dtype).blocks]

    assert blocks("float32") == ["LoopBlock"] * config.n_layers
    assert blocks("float64") == ["Block"] * config.n_layers
    torch_norms.install_row_products(None)
    assert blocks("float32") == ["Block"] * config.n_layers


def test_a_cache_of_another_batch_gets_the_lessons_error_and_never_the_cpp_call(torch_norms):
    import torch

    from kvports.torch_impl.model import init_cache

    torch_port = port_or_skip("torch")
    config = TINY_FAMILIES["llama"]
    model = torch_port.load_model(config, random_weights(config), "float32")
    calls: list[tuple[Any, ...]] = []
    torch_norms.INSTALLED[0].attention = lambda *args: calls.append(args)
    with torch.inference_mode(), pytest.raises(RuntimeError):
        model(torch.tensor([[3]]), init_cache(config, 2, 8, torch.float32))  # one row's step, a cache of two
    assert not calls  # the C++ call, which trusts the shapes, was never made
