"""Tensor parallelism in the torch port (torch_impl/fast/parallel.py): a model sharded over two gloo
ranks gives the tokens one process gives, in float64, in every mode; a rank that fails or dies
ends every rank. Slow: each sharded model spawns two interpreters that import torch."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvports.shared.errors import UserError
from kvports.shared.generation import GenerationConfig, pad_prompts
from tests.helpers.commands import running
from tests.helpers.models import TINY_FAMILIES, random_weights
from tests.helpers.ports import port_or_skip

pytestmark = pytest.mark.slow

# Left-padded rows of different lengths: every rank must agree on each row's positions and stops.
PROMPTS = pad_prompts([[3, 7, 9, 3, 7, 9, 3, 7], [11, 4, 11, 4, 11], [30, 2, 8, 30, 2, 8, 30, 2]])[0]
GENERATIONS = {
    "greedy": GenerationConfig(max_new_tokens=12),
    "sampled": GenerationConfig(max_new_tokens=12, temperature=0.9, top_k=20, top_p=0.95, seed=3, stop_ids=(5,)),
}
# The sum of each rank's partial products differs from one whole product in the last bits.
LOGITS_ATOL = 1e-12
# Query heads 4, key/value heads 1 (MQA): two ranks each hold a copy of the one key/value head. The tiny
# Gemma 3 is such a model: its ranks, already running for the family tests, serve this one too (a model
# of its own cost two more ranks, each an interpreter importing torch).
MQA = "gemma3"


def load_pair(config, seed: int = 0):
    """(one process, two ranks) of one model in float64."""
    torch_port = port_or_skip("torch")
    tensors = random_weights(config, seed)
    one = torch_port.load_model(config, tensors, "float64")
    return one, torch_port.load_model(config, tensors, "float64", tensor_parallel=2)


class Sharded:
    """The module's sharded models, each loaded once and kept until the module ends: starting two ranks
    (two interpreters importing torch) and ending them is most of this file's time. A test that ends a
    model's ranks `take`s one out; a later test asking for that config loads it again."""

    def __init__(self) -> None:
        self.pairs: dict[str, tuple] = {}

    def pair(self, name: str) -> tuple:
        """(one process, two ranks) of TINY_FAMILIES[name] in float64, its ranks running."""
        if name not in self.pairs or running(self.pairs[name][1].pids) != self.pairs[name][1].pids:
            self.pairs[name] = load_pair(TINY_FAMILIES[name])
        return self.pairs[name]

    def take(self):
        """A sharded model whose ranks run, the caller's to end: one this module started, or a new one."""
        name = next(iter(self.pairs), MQA)
        two = self.pair(name)[1]
        del self.pairs[name]
        return two

    def close(self) -> None:
        # Each close waits for its ranks to shut down (about a second and a half): the waits overlap.
        with concurrent.futures.ThreadPoolExecutor() as pool:
            list(pool.map(lambda pair: pair[1].close(), self.pairs.values()))


@pytest.fixture(scope="module")
def sharded():
    models = Sharded()
    yield models
    models.close()


@pytest.fixture(params=sorted(TINY_FAMILIES))
def pair(request, sharded):
    return sharded.pair(request.param)


@pytest.mark.parametrize("sampling", sorted(GENERATIONS))
def test_two_ranks_give_one_processs_tokens_and_logits(pair, sampling):
    torch_port = port_or_skip("torch")
    one, two = pair
    expected, expected_logits = torch_port.generate(one, PROMPTS, GENERATIONS[sampling], "cached", return_logits=True)
    tokens, logits = torch_port.generate(two, PROMPTS, GENERATIONS[sampling], "cached", return_logits=True)
    np.testing.assert_array_equal(tokens, expected)
    np.testing.assert_allclose(logits, expected_logits, rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("draft_kind", ["model", "ngram"])
@pytest.mark.parametrize("sampling", sorted(GENERATIONS))
def test_two_ranks_give_one_processs_speculative_tokens(pair, draft_kind, sampling):
    torch_port = port_or_skip("torch")
    one, two = pair
    draft = None
    if draft_kind == "model":  # a one-layer model of its own, whole on every rank
        draft_config = dataclasses.replace(one.config, n_layers=1)
        draft = torch_port.load_model(draft_config, random_weights(draft_config, seed=1), "float64")
    expected, expected_counts = torch_port.generate_speculative(one, draft, PROMPTS, GENERATIONS[sampling], 3)
    tokens, counts = torch_port.generate_speculative(two, draft, PROMPTS, GENERATIONS[sampling], 3)
    np.testing.assert_array_equal(tokens, expected)
    assert counts == expected_counts


def test_two_ranks_give_one_processs_logits_chunk_by_chunk(pair):
    torch_port = port_or_skip("torch")
    one, two = pair
    tokens = np.random.default_rng(0).integers(0, one.config.vocab_size, size=(2, 9))  # [B, T]
    expected = torch_port.forward_chunks(one, tokens, [4, 1, 4])
    np.testing.assert_allclose(torch_port.forward_chunks(two, tokens, [4, 1, 4]), expected, rtol=0, atol=LOGITS_ATOL)


def test_two_ranks_stream_each_token_as_it_is_made(pair):
    torch_port = port_or_skip("torch")
    streamed: list[np.ndarray] = []
    tokens, _ = torch_port.generate(pair[1], PROMPTS, GENERATIONS["sampled"], "cached", on_token=streamed.append)
    P = PROMPTS.shape[1]
    np.testing.assert_array_equal(np.stack(streamed, axis=1), tokens[:, P : P + len(streamed)])
    assert len(streamed) == GENERATIONS["sampled"].max_new_tokens or (tokens[:, -1] == -1).all()


def test_more_ranks_than_key_value_heads_replicate_them(sharded):
    torch_port = port_or_skip("torch")
    one, two = sharded.pair(MQA)
    assert (one.config.n_heads, one.config.n_kv_heads) == (4, 1)
    assert "key/value heads replicated" in two.layout
    # Naive too, briefly: each step's new width costs DTensor a new sharding decision per product.
    for mode, steps in (("cached", 12), ("naive", 4)):
        expected, expected_logits = torch_port.generate(one, PROMPTS, steps, mode, return_logits=True)
        tokens, logits = torch_port.generate(two, PROMPTS, steps, mode, return_logits=True)
        np.testing.assert_array_equal(tokens, expected)
        np.testing.assert_allclose(logits, expected_logits, rtol=0, atol=LOGITS_ATOL)


def test_a_rank_killed_mid_run_ends_every_rank_with_its_one_line_message(sharded):
    """A UserError: the command line prints it as its one `error:` line, not a traceback."""
    torch_port = port_or_skip("torch")
    two = sharded.take()
    pids = two.pids

    def kill_rank_1(token):
        if running(pids[1:]):
            os.kill(pids[1], signal.SIGKILL)

    with pytest.raises(UserError, match=r"^tensor-parallel rank 1 of 2 failed: died \(signal 9\)$"):
        torch_port.generate(two, PROMPTS, 40, "cached", on_token=kill_rank_1)
    assert running(pids) == []


def test_a_rank_that_raises_ends_every_rank_with_its_message(sharded):
    torch_port = port_or_skip("torch")
    two = sharded.take()
    out_of_vocabulary = np.full((1, 3), two.config.vocab_size, dtype=np.int64)  # the embedding's IndexError, each rank
    with pytest.raises(UserError, match=r"^tensor-parallel rank \d of 2 failed: IndexError: index out of range"):
        torch_port.generate(two, out_of_vocabulary, 4, "cached")
    assert running(two.pids) == []


def test_closing_ends_every_rank(sharded):
    torch_port = port_or_skip("torch")
    two = sharded.take()
    two.close()
    assert running(two.pids) == []
    with pytest.raises(RuntimeError, match="ranks have ended"):
        torch_port.generate(two, PROMPTS, 4, "cached")


def test_ranks_end_when_their_parent_dies():
    port_or_skip("torch")
    # A parent that loads a sharded model, says its ranks' ids, and is killed mid-run, at its first token.
    script = textwrap.dedent(
        """
        import os, signal
        import numpy as np
        from kvports.torch_impl import port
        from tests.helpers.models import llama_like, random_weights
        if __name__ == "__main__":
            config = llama_like(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=1, max_seq_len=16)
            model = port.load_model(config, random_weights(config), tensor_parallel=2)
            print(*model.pids, flush=True)
            die = lambda token: os.kill(os.getpid(), signal.SIGKILL)
            port.generate(model, np.array([[1, 2, 3]]), 12, "cached", on_token=die)
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parent = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300)
    pids = [int(pid) for pid in parent.stdout.split()]
    assert len(pids) == 2, parent.stderr
    assert running(pids, wait=30.0) == []  # each rank notices within a second; the bound is only a backstop
