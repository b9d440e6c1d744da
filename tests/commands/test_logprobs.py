"""`--logprobs` (and the API's `logprobs=`): each step's log-probability of its token and its top
alternatives, the log-softmax of that step's logits, ending at a row's stop, printed the same by
every port. (Out of bounds: tests/bad_input/test_sizes.py.)"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from scipy.special import log_softmax

from kvports import generating, loading
from kvports.registry import PORTS
from kvports.shared.generation import GenerationConfig
from tests.helpers.commands import run_cli
from tests.helpers.models import SEED
from tests.helpers.ports import port_or_skip


def test_logprobs_are_each_steps_log_softmax_of_the_logits(port, seed_weights):
    config, tensors = seed_weights
    loaded = loading.load_model(port.NAME, config, tensors, "float32", "cpu")
    inputs = generating.RunInputs(port.NAME, "cached", GenerationConfig(6, stop_ids=()), logprobs=3)
    prompts = generating.check_inputs(inputs, config, [SEED, SEED[:3]]).prompts
    result = generating.generate(loaded, prompts, inputs, return_logits=True)
    assert result.logits is not None and result.logprobs is not None
    expected = log_softmax(result.logits.astype(np.float64), axis=-1)  # [B, N, V]
    for row, (steps, generated) in enumerate(zip(result.logprobs, result.generated, strict=True)):
        assert [step["token"] for step in steps] == generated
        for index, step in enumerate(steps):
            assert step["logprob"] == pytest.approx(expected[row, index, step["token"]], abs=1e-9)
            top = np.argsort(-expected[row, index], kind="stable")[:3]
            assert [alternative["token"] for alternative in step["top"]] == top.tolist()
            assert [a["logprob"] for a in step["top"]] == pytest.approx(expected[row, index, top], abs=1e-9)


def test_logprobs_end_at_a_rows_stop(seed_weights):
    config, tensors = seed_weights
    loaded = loading.load_model("numpy", config, tensors, "float32", "cpu")
    inputs = generating.RunInputs("numpy", "cached", GenerationConfig(6, stop_ids=(221,)), logprobs=1)
    result = generating.generate(loaded, generating.check_inputs(inputs, config, [SEED]).prompts, inputs)
    assert [step["token"] for step in result.logprobs[0]] == [315, 391, 221]  # the stop token is the last


def test_logprobs_printed_are_the_same_in_every_port(capsys):
    printed = {}
    for name in PORTS:
        port_or_skip(name)
        argv = ["generate", "--framework", name, "--mode", "naive", "--new-tokens", "5", "--logprobs", "4"]
        code, out, err = run_cli(capsys, *argv)
        assert code == 0, err
        printed[name] = [line for line in out.splitlines() if line.lstrip().startswith("step")]
    assert len(printed["torch"]) == 5
    assert printed["torch"][0].split()[:4] == ["step", "0", "315", "-4.2828"]
    assert all(lines == printed["torch"] for lines in printed.values())


def test_the_api_returns_logprobs(port):
    import kvports

    result = kvports.load(port.NAME).generate(SEED, new_tokens=3, logprobs=2)
    assert [step["token"] for step in result.logprobs[0]] == result.generated[0]
    with pytest.raises(kvports.UserError, match=r"^logprobs=21 is above 20$"):
        kvports.load(port.NAME).generate(SEED, new_tokens=3, logprobs=21)


def test_with_a_tokenizer_each_token_shows_its_text_beside_its_id(capsys, chat_model):
    from kvports.formats.gguf.tokenizer import gguf_tokenizer

    argv = ["generate", "--framework", "numpy", "--mode", "cached", "--weights", chat_model, "--text", "hi"]
    code, out, err = run_cli(capsys, *argv, "--new-tokens", "3", "--logprobs", "2", "--no-stop")
    assert code == 0, err
    tokenizer = gguf_tokenizer(chat_model)
    steps = [re.match(r'\s*step\s+\d+\s+(\d+) ("(?:[^"\\]|\\.)*") ', line) for line in out.splitlines()]
    steps = [step for step in steps if step is not None]  # step N ID "TEXT" LOGPROB top: ...
    assert len(steps) == 3
    for step in steps:
        assert json.loads(step[2]) == tokenizer.decode([int(step[1])], skip_special_tokens=False)


def test_a_streamed_answer_is_printed_once(capsys, chat_model):
    argv = ["generate", "--framework", "numpy", "--mode", "cached", "--weights", chat_model, "--chat", "hi"]
    code, out, err = run_cli(capsys, *argv, "--new-tokens", "6", "--no-stop", "--stream")
    assert code == 0, err
    streamed = out.splitlines()[0]
    code, given, _ = run_cli(capsys, *argv[:-2], "--chat", "hi", "--new-tokens", "6", "--no-stop", "--json")
    assert streamed == json.loads(given)["answer"][0].rstrip("\ufffd")
    assert "  answer" not in out and "  text" not in out


def test_every_front_door_reports_the_same_logprobs_and_breaks_a_tie_by_the_lower_id(port):
    from kvports.batching.engine import BatchSettings, Engine
    from kvports.batching.request import Request
    from kvports.shared.config import ModelConfig
    from tests.helpers.models import random_weights

    config = ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=1, max_seq_len=32)
    tensors = random_weights(config)
    tensors["head.weight"][:] = 0  # every logit 0: each step is a 64-way tie
    loaded = loading.load_model(port.NAME, config, tensors, "float32", "cpu")
    generation = GenerationConfig(3, stop_ids=())
    inputs = generating.RunInputs(port.NAME, "cached", generation, logprobs=4)
    command_line = generating.generate(
        loaded, generating.check_inputs(inputs, config, [[5, 6, 7]]).prompts, inputs
    ).logprobs
    engine = Engine(loaded.port, loaded.model, config, BatchSettings(max_batch=1, block_size=4))
    sequence = engine.add(Request("a", (5, 6, 7), generation, logprobs=4))
    engine.run()
    batch = [
        {"token": step.token, "logprob": step.logprob, "top": [{"token": i, "logprob": p} for i, p in step.top]}
        for step in sequence.logprobs
    ]
    tied = {"token": 0, "logprob": -np.log(64.0), "top": [{"token": i, "logprob": -np.log(64.0)} for i in range(4)]}
    assert command_line == [[tied] * 3] and batch == [tied] * 3  # exactly: one function, float64, lower ids first
