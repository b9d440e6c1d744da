"""A step's products split across the threads the process is given (each port's fast/cores.py):
the split product is bit-identical to the unsplit one at float64 and float32 (output rows split,
each dot product whole), a whole generation's tokens and logits do not move, one thread splits
nothing, and torch splits across its own thread count unless told otherwise."""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from tests.helpers.models import llama_like, random_prompts, random_weights
from tests.helpers.ports import port_or_skip

# Where each port splits its products: `split_products(threads)` and `split_threads()`, same names.
SPLITTING = {"numpy": "kvports.numpy_impl.fast.cores", "torch": "kvports.torch_impl.fast.cores"}
SPLIT_PORTS = pytest.mark.parametrize("name", sorted(SPLITTING))


def numpy_product(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x [..., in] @ weight [out, in] as a loaded NumPy model runs it: the weight in its load-time
    memory order, through functional.linear (looked up now: the split replaces it)."""
    from kvports.numpy_impl import functional
    from kvports.numpy_impl.fast.layout import memory_order

    return functional.linear(x, np.asarray(weight, order=memory_order(weight)))  # [..., out]


def torch_product(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """The same through the torch port's linear (fast/onednn.py), the weight laid out as load_model lays it."""
    import torch

    from kvports.shared.shapes import stored_transposed
    from kvports.torch_impl.fast import onednn

    w = torch.from_numpy(weight)  # [out, in]
    w = w.t().contiguous().t() if stored_transposed(weight.shape) else w.contiguous()
    with torch.no_grad():
        return onednn.linear(torch.from_numpy(x), w).numpy()  # [..., out]


PRODUCT = {"numpy": numpy_product, "torch": torch_product}

# SmolLM2-135M's qkv, gate/up and down products (out, in), and two whose
# rows are no multiple of a piece's.
SHAPES = [(960, 576), (3072, 576), (576, 1536), (4999, 576), (300, 128)]


@pytest.fixture
def splitting(name, monkeypatch):
    """The port's split module, every product split (no size floor), put back after."""
    port_or_skip(name)
    module = importlib.import_module(SPLITTING[name])
    monkeypatch.setattr(module, "MIN_SPLIT_BYTES", 0)
    yield module
    module.split_products(None)  # the port's default again (NumPy: unsplit; torch: its thread count)


@contextlib.contextmanager
def counting_splits(name: str, monkeypatch) -> Iterator[list[int]]:
    """How many products the block split: NumPy's pool runs each piece but the caller's (threads
    named kvports-numpy), torch runs the pieces as one torch.bmm on its own threads."""
    import torch

    count: list[int] = []
    if name == "torch":
        bmm = torch.bmm

        def counted(*args, **kwargs):
            count.append(1)
            return bmm(*args, **kwargs)

        monkeypatch.setattr(torch, "bmm", counted)
        yield count
        monkeypatch.setattr(torch, "bmm", bmm)
    else:
        yield count
        count += [1 for thread in threading.enumerate() if thread.name.startswith("kvports-numpy")]


def unsplit_and_split(module, compute):
    module.split_products(1)
    unsplit = compute()
    module.split_products(2)
    return unsplit, compute()


@SPLIT_PORTS
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{o}x{i}" for o, i in SHAPES])
@pytest.mark.parametrize("rows", [1, 7])
def test_split_product_is_bit_identical(name, splitting, dtype, shape, rows):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal(shape).astype(dtype)  # [out, in]
    x = rng.standard_normal((1, rows, shape[1])).astype(dtype)  # [1, rows, in]
    unsplit, split = unsplit_and_split(splitting, lambda: PRODUCT[name](x, weight))
    assert np.array_equal(unsplit, split)


@SPLIT_PORTS
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_split_generation_keeps_tokens_and_logits(name, splitting, dtype, monkeypatch):
    port = port_or_skip(name)
    config = llama_like(vocab_size=512, d_model=256, n_heads=4, n_kv_heads=2, n_layers=2, max_seq_len=48)
    model = port.load_model(config, random_weights(config), dtype)
    prompts = random_prompts(config.vocab_size, 1, 17)  # batch 1: every port splits its one-row products

    def generate():
        return port.generate(model, prompts, 8, "cached", return_logits=True)

    with counting_splits(name, monkeypatch) as splits:
        (tokens, logits), (split_tokens, split_logits) = unsplit_and_split(splitting, generate)
    assert splits  # it did split
    assert np.array_equal(tokens, split_tokens)
    assert np.array_equal(logits, split_logits)


def functional_attention():
    """The attention every NumPy block calls now (functional.py's name, which the splits replace)."""
    from kvports.numpy_impl import functional

    return functional.scaled_dot_product_attention


def prompt_mask(kind: str, T: int):
    """The masks the NumPy model builds for a batch's prompt: causal, a sliding window and a chunk after
    7 cached tokens (S = T + 7) as one row every prompt shares ([1, 1, T, S]), a left-padded batch's
    a row a prompt ([2, 1, T, T])."""
    from kvports.numpy_impl.model import attention_mask, token_positions

    if kind == "cached chunk":
        return attention_mask(token_positions(7, T, None), token_positions(0, T + 7, None), None)  # [1, 1, T, T + 7]
    pad = np.array([0, 3]) if kind == "left-padded" else None  # the second row left-padded
    positions = token_positions(0, T, pad)  # [B, T]
    return attention_mask(positions, positions, 5 if kind == "window" else None)  # [B, 1, T, T]


# float64: the lesson's own, bit for bit; float32: blocks that sum in another order, within 1e-6 of it
PROMPT_TOLERANCE = {"float64": 0.0, "float32": 1e-6}


@pytest.mark.parametrize("name", ["numpy"])  # the one port whose prompt attention fast/ replaces
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("scale", [None, 0.3])  # Gemma 3's query_pre_attn_scalar gives its own scale
@pytest.mark.parametrize("kind", ["causal", "left-padded", "window", "cached chunk"])
def test_split_prompt_attention_matches_the_lessons(name, splitting, dtype, scale, kind, monkeypatch):
    from kvports.numpy_impl import functional

    monkeypatch.setattr(splitting, "QUERY_BLOCK", 32)  # 150 queries: blocks of 32, each seeing fewer keys
    rng = np.random.default_rng(0)
    mask = prompt_mask(kind, 150)  # [B or 1, 1, T, S]
    (_, _, T, S), B, H, Hkv, Dh = mask.shape, 2, 9, 3, 16  # two prompts; SmolLM2's 9 query heads over 3 k/v heads
    query = rng.standard_normal((B, H, T, Dh)).astype(dtype)  # [B, H, T, Dh]
    key, value = rng.standard_normal((2, B, Hkv, S, Dh)).astype(dtype)  # [B, Hkv, S, Dh] each

    def attend():
        return functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True, scale=scale)

    unsplit, split = unsplit_and_split(splitting, attend)
    assert functional.scaled_dot_product_attention != splitting.PLAIN_ATTENTION  # the prompt attention ran
    np.testing.assert_allclose(split, unsplit, rtol=0, atol=PROMPT_TOLERANCE[dtype])  # float64: equal


@pytest.mark.parametrize("name", ["numpy"])
@pytest.mark.parametrize("mode", ["naive", "cached", "speculative"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_prompt_attention_keeps_a_prompts_tokens_and_logits(name, splitting, dtype, threads, mode, monkeypatch):
    """A whole generation from two 70-token prompts (blocks of 64 and 6 queries; one mask row both
    share) in each mode with the prompt attention that `--threads 1` and `--threads 2` install, against
    the lesson's: the same tokens, float64's logits bit for bit."""
    port = port_or_skip(name)
    config = llama_like(vocab_size=256, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, max_seq_len=96)
    model = port.load_model(config, random_weights(config), dtype)
    prompts = random_prompts(config.vocab_size, 2, 70)  # [2, 70]

    def generate():
        return port.generate(model, prompts, 4, mode, return_logits=True)

    splitting.split_attention(None)
    tokens, logits = generate()
    splitting.split_attention(threads)
    assert functional_attention() != splitting.PLAIN_ATTENTION  # installed: the blocks ran
    split_tokens, split_logits = generate()
    assert np.array_equal(tokens, split_tokens)
    np.testing.assert_allclose(split_logits, logits, rtol=0, atol=100 * PROMPT_TOLERANCE[dtype])


@pytest.mark.parametrize("name", ["numpy"])
def test_prompt_attention_runs_openblas_at_one_thread_from_any_thread(name, splitting, monkeypatch):
    """The blocks run OpenBLAS at one thread (two levels of threads would wait for each other), also
    where the model runs on a thread of its own (the server's engine) while the main thread set the count."""
    from threadpoolctl import threadpool_limits

    from kvports.numpy_impl import functional

    with threadpool_limits(2, user_api="blas"):  # on the main thread: threadpoolctl's controlling thread
        splitting.split_attention(2)
        softmax, counts = functional.softmax, []

        def counted(*args, **kwargs):
            counts.append({get() for get, _ in splitting.ATTENTION[0].blas})
            return softmax(*args, **kwargs)

        monkeypatch.setattr(functional, "softmax", counted)
        rng = np.random.default_rng(0)
        mask = prompt_mask("causal", 40)  # [1, 1, T, T]
        query = rng.standard_normal((1, 4, 40, 8)).astype("float32")  # [B, H, T, Dh]
        key, value = rng.standard_normal((2, 1, 2, 40, 8)).astype("float32")  # [B, Hkv, S, Dh] each
        worker = threading.Thread(
            target=functional.scaled_dot_product_attention, args=(query, key, value, mask, True, None)
        )
        worker.start()
        worker.join()
        after = {get() for get, _ in splitting.ATTENTION[0].blas}
    assert counts and all(count == {1} for count in counts)
    assert after == {2}  # given back after


@pytest.mark.parametrize("name", ["numpy"])
def test_one_thread_runs_the_prompt_attention_on_the_calling_thread(name, splitting):
    """`--threads 1` gives NumPy's prompt attention its causal blocks (the masked half skipped) with no
    pool of threads; no count, the lesson's attention."""
    splitting.split_attention(1)
    assert functional_attention() == splitting.ATTENTION[0].attention
    assert splitting.attention_threads() == 1 and splitting.ATTENTION[0].pool is None
    splitting.split_attention(None)
    assert functional_attention() == splitting.PLAIN_ATTENTION and splitting.attention_threads() == 0


@SPLIT_PORTS
def test_one_thread_splits_nothing(name, splitting, monkeypatch):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((3072, 576)).astype("float32")  # [out, in]: SmolLM2's gate/up, split at 2
    x = rng.standard_normal((1, 1, 576)).astype("float32")  # [1, 1, in]
    splitting.split_products(1)
    with counting_splits(name, monkeypatch) as splits:
        PRODUCT[name](x, weight)
    assert splitting.split_threads() == 1
    assert not splits
    assert not getattr(splitting, "SPLIT", [])  # and NumPy made no pool


@pytest.mark.parametrize("name", ["torch"])
def test_torch_splits_across_its_own_threads_by_default(name, splitting):
    import torch

    splitting.split_products(None)
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            assert splitting.split_threads() == count
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ["torch"])
@pytest.mark.parametrize("shape", [(4999, 576), (300, 128)], ids=["4999x576", "300x128"])
def test_torch_leaves_a_product_unsplit_where_its_rows_do_not_cut_evenly(name, splitting, monkeypatch, shape):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal(shape).astype("float32")  # [out, in]: 2499.5 or 150 rows a piece
    x = rng.standard_normal((1, 1, shape[1])).astype("float32")  # [1, 1, in]
    splitting.split_products(2)
    with counting_splits(name, monkeypatch) as splits:
        PRODUCT[name](x, weight)
    assert not splits
