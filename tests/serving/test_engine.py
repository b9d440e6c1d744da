"""What the server asks of the batching engine: a request cancelled while it waits or runs gives its
blocks back at once and the others run on unchanged; a server's engine ends an overflowing row alone."""

from __future__ import annotations

import numpy as np

from kvports.batching.engine import BatchSettings, Engine
from kvports.batching.request import Request
from kvports.shared.config import ModelConfig
from kvports.shared.generation import GenerationConfig
from tests.helpers.models import random_weights
from tests.helpers.ports import port_or_skip
from tests.helpers.servers import OverflowingPort

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, max_seq_len=64)
SETTINGS = BatchSettings(max_batch=2, block_size=4, max_step_tokens=64, max_length=40)
PROMPTS = {"a": [7, 3, 50, 12, 9], "b": [41, 22, 5, 60, 18, 33], "c": [2, 8, 19]}


def engine_and_model(wrap=lambda port: port, **options):
    port = port_or_skip("numpy")
    model = port.load_model(CONFIG, random_weights(CONFIG, seed=5), "float64")
    return Engine(wrap(port), model, CONFIG, SETTINGS, dtype="float64", **options), port, model


def alone(port, model, name: str) -> list[int]:
    tokens, _ = port.generate(model, np.asarray([PROMPTS[name]]), GenerationConfig(8), "cached")  # [1, P + 8]
    return tokens[0].tolist()


def test_cancelled_requests_free_their_blocks_at_once_and_the_rest_run_unchanged():
    engine, port, model = engine_and_model()
    sequences = {
        name: engine.add(Request(name, tuple(prompt), GenerationConfig(8))) for name, prompt in PROMPTS.items()
    }
    engine.step()  # a and b run (max_batch 2), c waits
    engine.cancel(sequences["a"])  # running
    engine.cancel(sequences["c"])  # waiting: it never runs
    assert sequences["a"].finish_reason == sequences["c"].finish_reason == "cancelled"
    assert engine.blocks.num_used == len(sequences["b"].block_table)
    finished = engine.run()
    assert [sequence.request.id for sequence in finished] == ["b"]
    assert sequences["b"].tokens == alone(port, model, "b")
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_servers_engine_ends_an_overflowing_row_alone():
    engine, port, model = engine_and_model(lambda port: OverflowingPort(port, 50), end_nonfinite_rows=True)
    sequences = {name: engine.add(Request(name, tuple(PROMPTS[name]), GenerationConfig(8))) for name in ("a", "b")}
    finished = {sequence.request.id: sequence for sequence in engine.run()}
    assert finished["a"].finish_reason == "error"  # its prompt holds the marker the port overflows on
    assert sequences["b"].tokens == alone(port, model, "b")
    assert engine.blocks.num_free == engine.blocks.num_blocks and engine.blocks.by_hash == {}


class CountingPort:
    """A port that records the count of likeliest tokens each step is asked for."""

    def __init__(self, port):
        self.port, self.asked = port, []

    def __getattr__(self, name: str):
        return getattr(self.port, name)

    def paged_step(self, *args):
        self.asked.append(args[6])
        return self.port.paged_step(*args)


def test_a_row_gets_its_own_count_of_logprobs_and_steps_without_one_compute_none():
    counting = None

    def wrap(port):
        nonlocal counting
        counting = CountingPort(port)
        return counting

    engine, port, model = engine_and_model(wrap)
    plain = engine.add(Request("a", tuple(PROMPTS["a"]), GenerationConfig(8)))
    engine.run()
    asking = engine.add(Request("b", tuple(PROMPTS["b"]), GenerationConfig(8), logprobs=3))
    fewer = engine.add(Request("c", tuple(PROMPTS["c"]), GenerationConfig(8), logprobs=1))
    engine.run()
    assert set(counting.asked[: len(plain.generated)]) == {None} and plain.logprobs == []
    # The most a row of the step asks for: both rows at first, then whichever runs on.
    assert counting.asked[len(plain.generated)] == 3 and set(counting.asked[len(plain.generated) :]) <= {1, 3}
    for sequence, count in ((asking, 3), (fewer, 1)):
        assert [step.token for step in sequence.logprobs] == sequence.generated
        assert all(len(step.top) == count for step in sequence.logprobs)
        assert all(step.top[0][0] == step.token for step in sequence.logprobs)  # greedy: the likeliest
