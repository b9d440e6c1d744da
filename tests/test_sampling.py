"""Generation people use, the same in every port: sampling from shared random numbers,
stop tokens, and prompts of different lengths in one batch."""

from __future__ import annotations

import contextlib
import importlib

import numpy as np
import pytest

from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError
from kvports.shared.generation import PAD, GenerationConfig, finish_reasons, pad_prompts, row_tokens, uniforms
from tests.helpers.models import llama_like, random_weights
from tests.helpers.ports import calling_internals

# Untied, learned positions, GQA: small enough for float64 runs in every test.
CONFIG = ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, max_seq_len=64)
SETTINGS = [
    GenerationConfig(12, temperature=1.0, seed=0),
    GenerationConfig(12, temperature=0.7, top_k=5, seed=1),
    GenerationConfig(12, temperature=1.3, top_p=0.8, seed=2),
    GenerationConfig(12, temperature=0.9, top_k=20, top_p=0.5, seed=3),
]


def sampling_module(port):
    return importlib.import_module(port.__name__.rsplit(".", 1)[0] + ".sampling")


@pytest.fixture(scope="module")
def weights():
    return random_weights(CONFIG, seed=3)


def ragged_prompts():
    return pad_prompts([[5, 9, 2, 40, 7], [11, 3], [60, 1, 33, 8]])  # [3, 5] with PAD, pads [0, 3, 1]


@pytest.mark.parametrize("generation", SETTINGS, ids=lambda g: f"t{g.temperature}-k{g.top_k}-p{g.top_p}")
@pytest.mark.parametrize("mode", ["naive", "cached"])
def test_same_seed_gives_the_same_sampled_tokens_in_every_port(port, reference, weights, mode, generation):
    prompts, _ = ragged_prompts()
    expected, _ = reference.generate(reference.load_model(CONFIG, weights, "float64"), prompts, generation, "naive")
    tokens, _ = port.generate(port.load_model(CONFIG, weights, "float64"), prompts, generation, mode)
    assert tokens.tolist() == expected.tolist()


def test_a_different_seed_gives_different_tokens(port, weights):
    model = port.load_model(CONFIG, weights, "float64")
    prompts = np.array([[5, 9, 2, 40, 7]])
    first, _ = port.generate(model, prompts, GenerationConfig(16, temperature=1.0, seed=7), "cached")
    again, _ = port.generate(model, prompts, GenerationConfig(16, temperature=1.0, seed=7), "cached")
    other, _ = port.generate(model, prompts, GenerationConfig(16, temperature=1.0, seed=8), "cached")
    assert first.tolist() == again.tolist()
    assert first.tolist() != other.tolist()


@pytest.mark.parametrize(
    "generation",
    [GenerationConfig(10, temperature=0.0, seed=4), GenerationConfig(10, temperature=1.5, top_k=1, seed=4)],
    ids=["t0", "k1"],
)
def test_temperature_zero_and_top_k_one_are_greedy(port, weights, generation):
    model = port.load_model(CONFIG, weights, "float32")
    prompts = np.array([[5, 9, 2, 40, 7], [1, 2, 3, 4, 5]])
    greedy, _ = port.generate(model, prompts, 10, "cached")
    assert port.generate(model, prompts, generation, "cached")[0].tolist() == greedy.tolist()


def test_uniforms_are_a_stream_per_seed():
    draws = uniforms([5, 6, 7], 8)  # [B, N]
    assert draws.shape == (3, 8) and ((0 <= draws) & (draws < 1)).all()
    np.testing.assert_array_equal(uniforms([6], 8)[0], draws[1])  # a row's draws depend on its seed alone
    np.testing.assert_array_equal(uniforms([5, 6, 7], 4), draws[:, :4])  # nor on how many steps are asked for
    assert len({tuple(row) for row in draws}) == 3


def sample_many(port, logits, generation, draws):
    """The port's own sampling rule on one row of logits [V], once per uniform."""
    module = sampling_module(port)
    batch = np.repeat(logits[None], len(draws), axis=0)  # [M, V]
    if port.NAME == "torch":
        import torch

        return module.sample(torch.from_numpy(batch), generation, torch.from_numpy(draws)).numpy()
    if port.NAME == "jax":
        import jax.numpy as jnp

        with calling_internals(port):
            return np.asarray(module.sample(jnp.asarray(batch), generation, jnp.asarray(draws)))
    return module.sample(batch, generation, draws)


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize(
    "generation",
    [
        GenerationConfig(1, temperature=0.8, seed=0),
        GenerationConfig(1, temperature=1.0, top_k=6, seed=0),
        GenerationConfig(1, temperature=1.2, top_p=0.7, seed=0),
    ],
    ids=["plain", "top-k", "top-p"],
)
def test_one_sampled_step_follows_the_softmax_of_the_filtered_logits(port, generation):
    logits = np.random.default_rng(11).normal(0, 1.5, size=24)  # [V]
    draws = uniforms(range(20_000), 1)[:, 0]  # one draw per seed
    counts = np.bincount(sample_many(port, logits, generation, draws), minlength=24)
    order = np.argsort(-logits)
    keep = np.zeros(24, dtype=bool)
    keep[order[: generation.top_k or 24]] = True
    if generation.top_p < 1:  # the smallest most-likely set whose probability reaches top_p
        probs = softmax(logits[order[: generation.top_k or 24]] / generation.temperature)
        keep[:] = False
        keep[order[: int(np.searchsorted(np.cumsum(probs), generation.top_p) + 1)]] = True
    expected = np.where(keep, softmax(np.where(keep, logits / generation.temperature, -np.inf)), 0.0) * len(draws)
    assert counts[~keep].sum() == 0  # filtered tokens are never drawn
    chi2 = (((counts - expected) ** 2)[keep] / expected[keep]).sum()
    # Fixed seeds, so no flakiness; 3x the degrees of freedom is far past chance (p < 1e-6).
    assert chi2 < 3 * max(keep.sum() - 1, 1) + 20, (chi2, counts[keep], expected[keep].round(1))


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.9), (0, 0.3), (12, 0.6)])
def test_the_filter_equals_transformers_warpers(port, top_k, top_p):
    torch = pytest.importorskip("torch")
    generation_utils = pytest.importorskip("transformers.generation.logits_process")
    logits = np.random.default_rng(top_k + int(10 * top_p)).normal(0, 2, size=(4, 50))  # [B, V]
    expected = torch.from_numpy(logits.copy())
    if top_k:
        expected = generation_utils.TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = generation_utils.TopPLogitsWarper(top_p)(None, expected)
    module = sampling_module(port)
    if port.NAME == "torch":
        ours = module.filter_logits(torch.from_numpy(logits), top_k, top_p).numpy()
    elif port.NAME == "jax":
        import jax.numpy as jnp

        with calling_internals(port):
            ours = np.asarray(module.filter_logits(jnp.asarray(logits), top_k, top_p))
    else:
        ours = module.filter_logits(logits, top_k, top_p)
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(expected.numpy()))
    np.testing.assert_array_equal(ours[~np.isinf(ours)], logits[~np.isinf(ours)])


def filter_rows(port, logits, top_k, top_p):
    """The port's filter_logits over logits [B, V], with per-row settings ([B, 1] arrays) or one for every row."""
    module = sampling_module(port)
    per_row = not isinstance(top_k, int)
    if port.NAME == "torch":
        torch = pytest.importorskip("torch")
        settings = (torch.tensor(top_k)[:, None], torch.tensor(top_p)[:, None]) if per_row else (top_k, top_p)
        return module.filter_logits(torch.from_numpy(logits), *settings).numpy()
    if port.NAME == "jax":
        import jax.numpy as jnp

        settings = (jnp.asarray(top_k)[:, None], jnp.asarray(top_p)[:, None]) if per_row else (top_k, top_p)
        with calling_internals(port):
            return np.asarray(module.filter_logits(jnp.asarray(logits), *settings))
    settings = (np.asarray(top_k)[:, None], np.asarray(top_p)[:, None]) if per_row else (top_k, top_p)
    return module.filter_logits(logits, *settings)


# Each row's (top_k, top_p): every row filtering, some, none (a step that skips the sorts).
ROW_SETTINGS = [[(5, 1.0), (0, 0.7), (3, 0.5)], [(0, 1.0), (6, 1.0), (0, 1.0)], [(0, 1.0), (50, 1.0), (0, 0.6)]]


@pytest.mark.parametrize("rows", ROW_SETTINGS + [[(0, 1.0)] * 3], ids=["all", "top-k", "top-p", "none"])
def test_per_row_settings_filter_each_row_as_it_is_filtered_alone(port, rows):
    logits = np.random.default_rng(7).normal(0, 2, size=(3, 50))  # [B, V]
    top_k, top_p = (list(values) for values in zip(*rows, strict=True))
    together = filter_rows(port, logits, top_k, top_p)
    for row, (k, p) in enumerate(rows):
        np.testing.assert_array_equal(together[row : row + 1], filter_rows(port, logits[row : row + 1], k, p))


@contextlib.contextmanager
def counting_sorts(port, monkeypatch):
    """The sorts a port's sampling runs (JAX's run eagerly: a cond runs one branch), counted."""
    sorts: list[str] = []

    def counting(owner, name):
        sort = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *args, **kwargs: sorts.append(name) or sort(*args, **kwargs))

    if port.NAME == "torch":
        counting(pytest.importorskip("torch").Tensor, "sort")
        yield sorts
    elif port.NAME == "jax":
        import jax
        import jax.numpy as jnp

        counting(jnp, "sort")
        counting(jnp, "argsort")
        with jax.disable_jit():
            yield sorts
    else:
        counting(np, "sort")
        counting(np, "argsort")
        yield sorts


def test_a_step_where_no_row_filters_sorts_nothing(port, monkeypatch):
    """A server's decode step samples every row at once: rows asking for neither top-k nor top-p
    skip the sorts of the vocabulary (the JAX server's step sorted 16 rows of SmolLM2's 49,152 twice,
    ~420 ms); a step where one row filters sorts."""
    logits = np.random.default_rng(3).normal(0, 2, size=(3, 50))  # [B, V]
    with counting_sorts(port, monkeypatch) as sorts:
        filter_rows(port, logits, [0, 0, 50], [1.0, 1.0, 1.0])
        assert sorts == []
        filter_rows(port, logits, [0, 4, 0], [1.0, 1.0, 1.0])
        filter_rows(port, logits, [0, 0, 0], [1.0, 0.5, 1.0])
    assert sorts.count("sort") >= 1 and len(sorts) >= 2


@pytest.mark.parametrize("mode", ["naive", "cached"])
def test_stop_ids_end_rows_early_and_the_finish_reason_says_so(port, weights, mode):
    model = port.load_model(CONFIG, weights, "float64")
    prompts = np.array([[5, 9, 2, 40, 7], [1, 2, 3, 4, 5]])
    free, _ = port.generate(model, prompts, 12, mode)
    stop = int(free[0, 5 + 3])  # row 0's fourth token
    assert stop not in free[1, 5:].tolist() and stop not in free[0, 5:8].tolist(), "pick another prompt"
    tokens, _ = port.generate(model, prompts, GenerationConfig(12, stop_ids=(stop,)), mode)
    assert tokens[0].tolist() == free[0, :9].tolist() + [PAD] * 8  # the stop token kept, then nothing
    assert tokens[1].tolist() == free[1].tolist()  # the other row goes on
    assert finish_reasons(tokens, 5, (stop,)) == ["stop", "length"]
    assert [len(row) for row in row_tokens(tokens)] == [9, 17]


@pytest.mark.parametrize("mode", ["naive", "cached"])
def test_generation_ends_when_every_row_has_stopped(port, weights, mode):
    model = port.load_model(CONFIG, weights, "float64")
    prompts = np.array([[5, 9, 2, 40, 7]])
    free, free_logits = port.generate(model, prompts, 12, mode, return_logits=True)
    tokens, logits = port.generate(
        model, prompts, GenerationConfig(12, stop_ids=(int(free[0, 6]),)), mode, return_logits=True
    )
    assert logits.shape[1] == 2  # two steps made, no more
    np.testing.assert_allclose(logits, free_logits[:, :2], atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("mode", ["naive", "cached"])
def test_rows_of_a_ragged_batch_equal_the_rows_run_alone(port, weights, mode, dtype):
    model = port.load_model(CONFIG, weights, dtype)
    rows = [[5, 9, 2, 40, 7], [11, 3], [60, 1, 33, 8]]
    prompts, pad = ragged_prompts()
    tokens, logits = port.generate(model, prompts, 10, mode, return_logits=True)
    for row, (prompt, padding) in enumerate(zip(rows, pad, strict=True)):
        alone, alone_logits = port.generate(model, np.array([prompt]), 10, mode, return_logits=True)
        assert tokens[row, padding:].tolist() == alone[0].tolist()
        np.testing.assert_allclose(logits[row], alone_logits[0], atol=1e-4 if dtype == "float32" else 1e-10, rtol=0)


@pytest.mark.parametrize("window", [3, None])
def test_ragged_rows_equal_rows_alone_with_rope_and_a_sliding_window(port, window):
    config = llama_like(
        vocab_size=64, d_model=32, n_heads=4, n_kv_heads=1, n_layers=2, max_seq_len=64, sliding_window=window
    )
    model = port.load_model(config, random_weights(config, seed=4), "float64")
    rows = [[5, 9, 2, 40, 7], [11, 3], [60, 1, 33, 8]]
    prompts, pad = ragged_prompts()
    for mode in ("naive", "cached"):
        tokens, _ = port.generate(model, prompts, 9, mode)
        for row, (prompt, padding) in enumerate(zip(rows, pad, strict=True)):
            assert tokens[row, padding:].tolist() == port.generate(model, np.array([prompt]), 9, mode)[0][0].tolist()


@pytest.mark.parametrize(
    "bad,message",
    [
        (dict(temperature=-0.5), "temperature -0.5"),
        (dict(temperature=float("nan")), "temperature nan"),
        (dict(top_k=-1), "top-k -1"),
        (dict(top_p=0.0), "top-p 0.0"),
        (dict(top_p=1.5), "top-p 1.5"),
        (dict(seed=-3), "seed -3"),
        (dict(stop_ids=(64,)), "stop id 64"),
        (dict(max_new_tokens=0), "new tokens 0"),
    ],
)
def test_bad_generation_settings_are_refused_by_name(bad, message):
    settings = dict(max_new_tokens=4) | bad
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        GenerationConfig(**settings).validate(CONFIG.vocab_size)
