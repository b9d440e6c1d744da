"""NumPy's float32 decode products as numba's compiled loop (numpy_impl/fast/row_loop.py): OpenBLAS's
products to float32 rounding at every shape, the same bits at every thread count, the lesson's own
product for everything else, installed by --threads with every float32 weight laid out by rows, and
OpenBLAS's products without numba."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

from tests.helpers.models import llama_like, random_prompts, random_weights
from tests.helpers.ports import port_or_skip

# SmolLM2-135M's proj, qkv, gate/up and down (out, in), and rows no thread count divides
SHAPES = [(576, 576), (960, 576), (3072, 576), (576, 1536), (4999, 576), (7, 5)]


@pytest.fixture
def row_loop():
    """The module, the loop compiled (numba required), and the lesson's product put back after."""
    port_or_skip("numpy")
    pytest.importorskip("numba")
    from kvports.numpy_impl.fast import row_loop

    assert row_loop.compiled_loop() is not None
    yield row_loop
    row_loop.install_row_products(None)


def installed_product(row_loop, threads: int):
    from kvports.numpy_impl import functional

    assert row_loop.install_row_products(threads) is not None
    return functional.linear


@pytest.mark.parametrize("shape", SHAPES)
def test_the_loop_gives_openblas_products_to_float32_rounding_at_every_shape(row_loop, shape):
    from kvports.numpy_impl.fast.cores import PLAIN_LINEAR

    rng = np.random.default_rng(0)
    weight = rng.standard_normal(shape, dtype=np.float32)  # [out, in], C order: the loop's layout
    x = rng.standard_normal((1, 1, shape[1]), dtype=np.float32)  # [B, T, in]: a decode step's one row
    expected = PLAIN_LINEAR(x, weight)  # [1, 1, out]
    got = installed_product(row_loop, 2)(x, weight)
    assert got.shape == expected.shape and got.dtype == np.float32
    scale = np.sqrt(shape[1])  # a sum of `in` unit products: its rounding grows with its length
    np.testing.assert_allclose(got, expected, rtol=0, atol=4e-6 * scale)


@pytest.mark.parametrize("shape", [(4999, 576), (7, 5)])
def test_every_thread_count_gives_the_same_bits(row_loop, shape):
    rng = np.random.default_rng(1)
    weight = rng.standard_normal(shape, dtype=np.float32)
    x = rng.standard_normal((1, shape[1]), dtype=np.float32)
    results = [installed_product(row_loop, threads)(x, weight) for threads in (1, 2, 3, 8)]
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])


def test_a_bias_is_added_after_the_loop(row_loop):
    from kvports.numpy_impl.fast.cores import PLAIN_LINEAR

    rng = np.random.default_rng(2)
    weight = rng.standard_normal((96, 64), dtype=np.float32)
    bias = rng.standard_normal(96, dtype=np.float32)
    x = rng.standard_normal((1, 64), dtype=np.float32)
    np.testing.assert_allclose(
        installed_product(row_loop, 2)(x, weight, bias), PLAIN_LINEAR(x, weight, bias), atol=1e-5
    )


@pytest.mark.parametrize(
    "case", ["float64", "a prompt longer than FEW_ROWS", "weight stored transposed", "float64 weight"]
)
def test_float64_long_prompts_and_transposed_weights_run_the_lessons_product(row_loop, case):
    from kvports.numpy_impl.fast.cores import PLAIN_LINEAR

    rng = np.random.default_rng(3)
    weight = rng.standard_normal((96, 64), dtype=np.float32)  # [out, in]
    x = rng.standard_normal((1, 64), dtype=np.float32)
    if case == "float64":
        x, weight = x.astype(np.float64), weight.astype(np.float64)
    elif case == "a prompt longer than FEW_ROWS":
        x = rng.standard_normal((1, row_loop.FEW_ROWS + 1, 64), dtype=np.float32)  # [1, T, in]
    elif case == "weight stored transposed":
        weight = np.asfortranarray(weight)  # weight.T contiguous: OpenBLAS's order for this shape
    else:
        weight = weight.astype(np.float64)
    np.testing.assert_array_equal(installed_product(row_loop, 2)(x, weight), PLAIN_LINEAR(x, weight))


# [B, T, in]: a batch's decode step, short prompts
@pytest.mark.parametrize("shape", [(2, 1, 576), (1, 5, 576), (3, 1, 1536), (1, 8, 576)])
def test_up_to_loop_rows_each_row_gets_its_own_one_row_products_bits(row_loop, shape):
    rng = np.random.default_rng(6)
    weight = rng.standard_normal((960, shape[-1]), dtype=np.float32)  # [out, in]
    x = rng.standard_normal(shape, dtype=np.float32)
    assert shape[0] * shape[1] <= row_loop.LOOP_ROWS
    product = installed_product(row_loop, 2)
    got = product(x, weight)  # [B, T, out]
    alone = np.stack([product(row[None], weight)[0] for row in x.reshape(-1, shape[-1])])  # [B T, out], a row at a time
    np.testing.assert_array_equal(got.reshape(-1, weight.shape[0]), alone)


@pytest.mark.parametrize("rows", [9, 64])
def test_a_few_rows_give_openblas_products_to_float32_rounding_in_row_order(row_loop, rows):
    # Which operand order OpenBLAS gets is a matter of speed (docs/BENCH.md); the values stay its products.
    from kvports.numpy_impl.fast.cores import PLAIN_LINEAR

    rng = np.random.default_rng(7)
    weight = rng.standard_normal((960, 576), dtype=np.float32)  # [out, in]
    bias = rng.standard_normal(960, dtype=np.float32)
    x = rng.standard_normal((1, rows, 576), dtype=np.float32)  # [1, T, in]: a short prompt
    assert row_loop.LOOP_ROWS < rows <= row_loop.FEW_ROWS
    got = installed_product(row_loop, 2)(x, weight, bias)
    expected = PLAIN_LINEAR(x, weight, bias)  # [1, T, out]
    assert got.shape == expected.shape and got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_allclose(got, expected, rtol=0, atol=4e-6 * np.sqrt(576))


def test_an_overflow_still_reaches_the_output(row_loop):
    # an overflowing step must reach the logits as inf or nan (the ports check for it), never as a finite number
    weight = np.ones((64, 32), dtype=np.float32)
    weight[5, 3] = np.inf
    weight[9, 0] = np.nan
    x = np.full((1, 32), 3e37, dtype=np.float32)  # every other row's sum overflows float32 too
    got = installed_product(row_loop, 2)(x, weight)
    assert not np.isfinite(got).any()
    assert np.isnan(got[0, 9]) and np.isposinf(got[0, 0])


def test_a_call_from_another_thread_runs_on_the_processs_count(row_loop):
    import numba

    product = installed_product(row_loop, 1)
    weight = np.ones((64, 32), dtype=np.float32)
    seen: list[int] = []

    def call() -> None:  # numba's count is per thread: a server's engine thread starts at numba's default
        product(np.ones((1, 32), dtype=np.float32), weight)
        seen.append(numba.get_num_threads())

    worker = threading.Thread(target=call)
    worker.start()
    worker.join()
    assert seen == [1]


def test_use_threads_installs_it_and_lays_out_float32_weights_by_rows(row_loop):
    numpy_port = port_or_skip("numpy")
    from kvports.shared.shapes import stored_transposed
    from kvports.threads import use_threads

    config = llama_like(vocab_size=256, d_model=64, n_heads=4, n_layers=1, max_seq_len=32)
    tensors = random_weights(config)
    use_threads(2)  # the suite's fixture (conftest.suite_threads) puts the counts back after
    assert row_loop.row_threads() == 2
    assert numpy_port.linear_route("float32", "none", "cpu") == "numba+blas"
    assert numpy_port.linear_route("float64", "none", "cpu") == "blas"
    for dtype, by_rows in (("float32", True), ("float64", False)):
        model = numpy_port.load_model(config, tensors, dtype)
        matrices = [getattr(owner, attr) for _, owner, attr in model.named_parameters()]
        matrices = [array for array in matrices if array.ndim == 2]
        assert matrices
        for array in matrices:
            expected_c = by_rows or not stored_transposed(array.shape)
            assert array.flags.c_contiguous == expected_c, (dtype, array.shape)


def test_a_generation_keeps_its_tokens_and_every_thread_count_its_logits(row_loop):
    numpy_port = port_or_skip("numpy")
    config = llama_like(vocab_size=256, d_model=64, n_heads=4, n_layers=2, max_seq_len=48)
    tensors = random_weights(config, seed=5)
    prompt = random_prompts(config.vocab_size, batch=1, length=6, seed=5)  # [1, 6]
    lesson = numpy_port.generate(numpy_port.load_model(config, tensors, "float32"), prompt, 12, "cached", True)
    runs = []
    for threads in (1, 2):
        row_loop.install_row_products(threads)
        model = numpy_port.load_model(config, tensors, "float32")  # laid out by rows while installed
        runs.append(numpy_port.generate(model, prompt, 12, "cached", True))
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


def test_an_avx2_only_cpu_gets_a_loop_compiled_for_avx2(tmp_path):
    # KVPORTS_CPU=avx2 stands for an AVX2 machine (shared/cpu.py): the loop must not use AVX-512's registers there.
    port_or_skip("numpy")
    pytest.importorskip("numba")
    import platform
    import subprocess

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("AVX2 is an x86-64 instruction set")
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
