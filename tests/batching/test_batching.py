"""Continuous batching over a paged KV cache: every request gets the tokens it gets alone, in
every port, however it shares the batch (arriving late, stopping early, sharing a prefix,
preempted); the block manager's and the scheduler's accounting; `kvports batch`."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from kvports.batching.blocks import BlockManager, chain_hash
from kvports.batching.engine import BatchSettings, Engine
from kvports.batching.request import Request
from kvports.batching.request_file import parse_requests
from kvports.batching.scheduler import MIN_FILL, Scheduler, Sequence
from kvports.formats.chat import chat_ids
from kvports.formats.gguf.tokenizer import gguf_tokenizer
from kvports.registry import PORTS
from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError
from kvports.shared.generation import PAD, GenerationConfig, RowSampling, row_tokens
from tests.helpers.agreement import assert_tokens_agree
from tests.helpers.commands import assert_one_error_line, run_batch, run_cli
from tests.helpers.models import TINY_FAMILIES, random_weights
from tests.helpers.ports import port_or_skip

# GQA, learned positions: small enough for float64 in every test. Blocks of 4 tokens, so short
# prompts span several blocks; one engine shape everywhere, so JAX compiles each program once.
CONFIG = ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, max_seq_len=64)
SETTINGS = BatchSettings(max_batch=4, block_size=4, max_step_tokens=64, max_length=48)
PREFIX = [7, 3, 50, 12, 9, 41, 22, 5, 60, 18, 33, 2]  # three full blocks


@pytest.fixture(params=[pytest.param(name, marks=[pytest.mark.slow] if name == "jax" else []) for name in PORTS])
def port(request):
    """conftest's `port`, JAX's marked slow: its alone runs compile a generation program per prompt
    length and setting, and its engine one step program per shape (a second or two each)."""
    return port_or_skip(request.param)


@pytest.fixture(scope="module")
def weights():
    return random_weights(CONFIG, seed=5)


def request(name: str, prompt, new_tokens: int, **settings) -> Request:
    return Request(name, tuple(prompt), GenerationConfig(new_tokens, **settings))


def ragged_requests():
    """Prompts of 1 to 17 tokens wanting 3 to 20 tokens: they arrive, run and finish at different steps."""
    rng = np.random.default_rng(11)
    lengths = [(5, 12), (17, 3), (1, 20), (9, 7), (13, 15), (2, 9)]
    return [request(f"r{i}", rng.integers(0, 64, size=p).tolist(), n) for i, (p, n) in enumerate(lengths)]


def run_engine(port, model, requests, settings=SETTINGS, arrivals=None, config=CONFIG):
    """Every request through one engine, request i queued before step arrivals[i] (default: all
    at once); the engine and each request's sequence, by id."""
    engine = Engine(port, model, config, settings)
    arrivals = arrivals or [0] * len(requests)
    pending = sorted(zip(arrivals, range(len(requests)), strict=False))
    finished, step = {}, 0
    while pending or not engine.idle:
        while pending and pending[0][0] <= step:
            engine.add(requests[pending.pop(0)[1]])
        finished.update({sequence.request.id: sequence for sequence in engine.step()})
        step += 1
    return engine, finished


def generate_alone(port, model, req, requests, return_logits=False):
    """port.generate for the request alone: one row, its prompt left-padded to the longest of
    `requests` (rounded up to 8) and run as long as the longest wants, then cut to its own
    length. Each request gets one shape, so JAX compiles one program per setting instead of one
    per request; a padded row gets the tokens it gets unpadded (tests/test_sampling.py), and the
    first n draws of a longer run are the n draws of a shorter one."""
    width = -(-max(len(other.prompt) for other in requests) // 8) * 8
    steps = -(-max(other.generation.max_new_tokens for other in requests) // 8) * 8
    if width + steps > model.config.max_seq_len:  # no room to round up
        width = max(len(other.prompt) for other in requests)
        steps = max(other.generation.max_new_tokens for other in requests)
    prompt = np.full((1, width), PAD)  # [1, width]: PAD on the left
    prompt[0, width - len(req.prompt) :] = req.prompt
    generation = dataclasses.replace(req.generation, max_new_tokens=steps)
    tokens, logits = port.generate(model, prompt, generation, "cached", return_logits=return_logits)
    P, N = len(req.prompt), req.generation.max_new_tokens
    alone = tokens[:, width - P : width + N]  # [1, P + N]
    return alone, None if logits is None else logits[:, :N]  # [1, N, V]


def assert_tokens_alone(port, model, requests, finished, dtype):
    """Each request's tokens equal port.generate's for it alone: exactly in float64; in float32
    up to a near-tie of the alone run's logits."""
    for req in requests:
        alone, logits = generate_alone(port, model, req, requests, return_logits=dtype == "float32")
        batched = np.full(alone.shape, PAD)  # [1, P + N], PAD after a stop, as generate returns it
        tokens = finished[req.id].tokens
        batched[0, : len(tokens)] = tokens
        if dtype == "float64":
            assert row_tokens(batched) == row_tokens(alone), req.id
        else:
            assert_tokens_agree(alone, logits, batched, len(req.prompt), f"{port.NAME} {req.id}")


# ---------------------------------------------------------------- every request equals itself alone


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_requests_arriving_while_others_run_get_their_tokens_alone(port, weights, dtype):
    model = port.load_model(CONFIG, weights, dtype)
    requests = ragged_requests()
    engine, finished = run_engine(port, model, requests, arrivals=[0, 0, 2, 3, 7, 15])
    assert engine.stats.steps["prefill"] > 1 and engine.stats.steps["decode"] > 1
    assert_tokens_alone(port, model, requests, finished, dtype)


def test_requests_stopping_at_different_steps_get_their_tokens_alone(port, weights):
    model = port.load_model(CONFIG, weights, "float64")
    requests, ragged = [], ragged_requests()
    for index, req in enumerate(ragged[:4]):
        alone, _ = generate_alone(port, model, req, ragged)  # the shape every float64 alone run here has
        stop = int(alone[0, len(req.prompt) + index])  # the alone run's token at step `index` ends this one
        requests.append(request(req.id, req.prompt, 20, stop_ids=(stop,)))
    _, finished = run_engine(port, model, requests)
    assert {sequence.finish_reason for sequence in finished.values()} == {"stop"}
    assert sorted(len(sequence.generated) for sequence in finished.values()) != [20] * 4
    assert_tokens_alone(port, model, requests, finished, "float64")


def test_sampled_requests_get_their_tokens_alone(port, weights):
    model = port.load_model(CONFIG, weights, "float64")
    samplings = [
        dict(temperature=1.0, seed=1),
        dict(temperature=0.7, top_k=5, seed=2),
        dict(),
        dict(temperature=1.3, top_p=0.8, seed=3),
        dict(temperature=1.0, seed=4),
    ]
    requests = [
        request(req.id, req.prompt, 8, **sampling) for req, sampling in zip(ragged_requests(), samplings, strict=False)
    ]
    _, finished = run_engine(port, model, requests, arrivals=[0, 0, 1, 1, 4])
    assert_tokens_alone(port, model, requests, finished, "float64")


def test_requests_sharing_a_prefix_reuse_its_blocks_and_get_their_tokens_alone(port, weights):
    model = port.load_model(CONFIG, weights, "float64")
    requests = [request(f"p{i}", PREFIX + suffix, 6) for i, suffix in enumerate([[1, 2], [3], [4, 5, 6, 7, 8], [9]])]
    requests.append(request("whole", PREFIX, 6))  # the prefix alone: its last block is computed, not reused
    engine, finished = run_engine(port, model, requests, arrivals=[0, 0, 3, 3, 3])
    assert [finished[f"p{i}"].cached_tokens for i in range(4)] == [0, 12, 12, 12]
    assert finished["whole"].cached_tokens == 8
    prompt_tokens = sum(len(req.prompt) for req in requests)
    assert engine.stats.prefill_tokens == prompt_tokens - 3 * 12 - 8
    assert_tokens_alone(port, model, requests, finished, "float64")


def test_preempted_requests_are_recomputed_and_get_their_tokens_alone(port, weights):
    model = port.load_model(CONFIG, weights, "float64")
    requests = ragged_requests()
    tiny = BatchSettings(max_batch=4, block_size=4, max_step_tokens=64, max_length=48, num_blocks=9)
    engine, finished = run_engine(port, model, requests, tiny)
    assert engine.stats.preemptions > 0
    assert_tokens_alone(port, model, requests, finished, "float64")


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_each_family_gets_its_tokens_alone(port, family):
    # A tied GPT-2, GQA Llama with RoPE, and Mistral's sliding window, masked over the gathered blocks.
    config = TINY_FAMILIES[family]
    model = port.load_model(config, random_weights(config, seed=2), "float64")
    requests = ragged_requests()[:4]
    _, finished = run_engine(port, model, requests, arrivals=[0, 1, 2, 3], config=config)
    assert_tokens_alone(port, model, requests, finished, "float64")


# ---------------------------------------------------------------- block accounting


@pytest.mark.parametrize("case", ["lengths", "stops", "preemption"])
def test_every_block_is_free_after_a_run(port, weights, case):
    model = port.load_model(CONFIG, weights, "float32")
    requests = ragged_requests()
    settings = SETTINGS
    if case == "stops":
        requests = [request(req.id, req.prompt, 20, stop_ids=tuple(range(0, 64, 3))) for req in requests]
    if case == "preemption":
        settings = BatchSettings(max_batch=4, block_size=4, max_step_tokens=64, max_length=48, num_blocks=9)
    engine, finished = run_engine(port, model, requests, settings)
    assert len(finished) == len(requests)
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert all(block.ref_count == 0 for block in engine.blocks.blocks)


class FailingPort:
    """A port whose paged_step fails on its `fail_at`-th call (0-based)."""

    def __init__(self, port, fail_at: int):
        self.port, self.fail_at, self.calls = port, fail_at, 0
        self.init_block_pool = port.init_block_pool

    def paged_step(self, *args):
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            raise RuntimeError("the device fell over")
        return self.port.paged_step(*args)


def test_a_failing_step_ends_every_request_and_frees_every_block(port, weights):
    model = port.load_model(CONFIG, weights, "float64")
    failing = FailingPort(port, fail_at=3)
    engine = Engine(failing, model, CONFIG, SETTINGS)
    sequences = [engine.add(req) for req in ragged_requests()]
    with pytest.raises(RuntimeError, match="fell over"):
        while not engine.idle:
            engine.step()
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert {sequence.finish_reason for sequence in sequences} == {"error"}
    assert engine.blocks.by_hash == {}  # blocks registered for the failed step were never written


def test_an_engine_runs_again_after_a_failed_step(port, weights):
    model = port.load_model(CONFIG, weights, "float64")
    requests = ragged_requests()[:3]
    engine = Engine(FailingPort(port, fail_at=2), model, CONFIG, SETTINGS)
    for req in requests:
        engine.add(req)
    with pytest.raises(RuntimeError):
        engine.run()
    for req in requests:
        engine.add(req)
    finished = {sequence.request.id: sequence for sequence in engine.run()}
    assert_tokens_alone(port, model, requests, finished, "float64")


# ---------------------------------------------------------------- the block manager


def test_sequences_with_one_prefix_share_its_blocks_and_count_references():
    blocks = BlockManager(num_blocks=8, block_size=4)
    first, cached_first = blocks.allocate(PREFIX + [1])
    second, cached_second = blocks.allocate(PREFIX + [2, 3])
    assert (cached_first, cached_second) == (0, 12)
    assert second[:3] == first[:3] and second[3] != first[3]
    assert [blocks.blocks[b].ref_count for b in first[:3]] == [2, 2, 2]
    blocks.free_table(first)
    assert blocks.num_used == 4  # the shared three and the second's own last block
    blocks.free_table(second)
    assert blocks.num_free == 8


def test_a_block_after_a_different_prefix_is_not_a_hit():
    blocks = BlockManager(num_blocks=8, block_size=4)
    blocks.allocate(PREFIX + [1])
    other = [99] + PREFIX[1:] + [1]  # same tokens in blocks 1 and 2, after a different block 0
    assert blocks.cached_prefix(other) == []
    assert chain_hash(chain_hash(b"", PREFIX[:4]), PREFIX[4:8]) != chain_hash(chain_hash(b"", other[:4]), other[4:8])


def test_the_block_of_a_prompts_last_token_is_never_taken_from_the_cache():
    blocks = BlockManager(num_blocks=8, block_size=4)
    blocks.allocate(PREFIX)
    assert len(blocks.cached_prefix(PREFIX)) == 2  # 12 tokens: the third block holds the last token
    assert len(blocks.cached_prefix(PREFIX + [1])) == 3


def test_a_freed_prefix_stays_findable_until_its_blocks_are_reused():
    blocks = BlockManager(num_blocks=4, block_size=4)
    table, _ = blocks.allocate(PREFIX + [1])
    blocks.free_table(table)
    assert len(blocks.cached_prefix(PREFIX + [2])) == 3
    blocks.allocate([60] * 8)  # two blocks: the freed tail first (block 3, then block 2, the prefix's last)
    assert len(blocks.cached_prefix(PREFIX + [2])) == 2


def test_a_cached_block_in_use_costs_no_free_block():
    blocks = BlockManager(num_blocks=5, block_size=4)
    blocks.allocate(PREFIX + [1])  # 4 blocks, 1 free
    assert blocks.can_allocate(PREFIX + [2])  # 3 shared + 1 new
    assert not blocks.can_allocate([5] * 9)  # 3 new


def test_decoding_takes_a_block_at_each_block_boundary_and_registers_full_blocks():
    blocks = BlockManager(num_blocks=4, block_size=4)
    tokens = [1, 2, 3, 4, 5]
    table, _ = blocks.allocate(tokens)  # positions 0..4: two blocks
    for position in range(5, 9):
        tokens.append(position)
        assert blocks.needs_block(table, position) == (position == 8)
        blocks.append_slot(table, tokens, position)
    assert len(table) == 3
    assert blocks.cached_prefix(tokens + [0]) == table[:2]  # the second block, filled while decoding, is findable


def test_without_prefix_caching_nothing_is_shared():
    blocks = BlockManager(num_blocks=8, block_size=4, prefix_caching=False)
    first, _ = blocks.allocate(PREFIX + [1])
    second, cached = blocks.allocate(PREFIX + [1])
    assert cached == 0 and set(first).isdisjoint(second)


def test_freeing_a_block_twice_is_an_error():
    blocks = BlockManager(num_blocks=2, block_size=4)
    table, _ = blocks.allocate([1, 2])
    blocks.free_table(table)
    with pytest.raises(RuntimeError):
        blocks.free_table(table)


# ---------------------------------------------------------------- the scheduler


def sequence_of(name: str, length: int, new_tokens: int = 4) -> Sequence:
    """A request whose prompt no other name shares (no prefix-cache hits between them)."""
    rng = np.random.default_rng(list(name.encode()))
    return Sequence(request(name, rng.integers(0, 64, size=length).tolist(), new_tokens), arrival=0.0)


def test_waiting_prompts_prefill_before_running_ones_decode():
    scheduler = Scheduler(BlockManager(16, 4), max_batch=4, max_step_tokens=64)
    scheduler.add(sequence_of("a", 5))
    first = scheduler.schedule()
    scheduler.finish_step(first, [1], now=0.0)
    scheduler.add(sequence_of("b", 3))
    step = scheduler.schedule()
    assert step.kind == "prefill" and [s.request.id for s in step.sequences] == ["b"]


def test_a_prefill_step_pads_shorter_prompts_on_the_left():
    scheduler = Scheduler(BlockManager(16, 4), max_batch=4, max_step_tokens=64)
    scheduler.add(sequence_of("a", 5))
    scheduler.add(sequence_of("b", 3))
    step = scheduler.schedule()
    assert step.tokens.shape == (2, 5)
    assert step.tokens[1, :2].tolist() == [PAD, PAD] and PAD not in step.tokens[1, 2:]


def test_the_running_batch_never_exceeds_max_batch():
    scheduler = Scheduler(BlockManager(64, 4), max_batch=3, max_step_tokens=1000)
    for name in "abcde":
        scheduler.add(sequence_of(name, 4))
    assert len(scheduler.schedule().sequences) == 3
    assert scheduler.schedule().kind == "decode"


def test_a_prefill_step_stays_within_the_token_budget():
    scheduler = Scheduler(BlockManager(64, 4), max_batch=8, max_step_tokens=12)
    for name in "abcd":
        scheduler.add(sequence_of(name, 4))
    assert len(scheduler.schedule().sequences) == 3  # 3 x 4 tokens


def test_a_lone_prompt_longer_than_the_budget_still_runs():
    scheduler = Scheduler(BlockManager(64, 4), max_batch=8, max_step_tokens=4)
    scheduler.add(sequence_of("a", 9))
    assert scheduler.schedule().tokens.shape == (1, 9)


def test_a_short_prompt_after_a_long_one_waits_rather_than_fill_a_step_with_padding():
    scheduler = Scheduler(BlockManager(64, 4), max_batch=8, max_step_tokens=1000)
    for name, length in (("long", 20), ("short", 18), ("shorter", 2)):
        scheduler.add(sequence_of(name, length))
    step = scheduler.schedule()
    assert [s.request.id for s in step.sequences] == ["long", "short"]
    assert (20 + 18) / 40 >= MIN_FILL > (20 + 18 + 2) / 60


def test_the_newest_running_sequence_is_preempted_and_waits_first_in_line():
    scheduler = Scheduler(BlockManager(4, 4), max_batch=4, max_step_tokens=64)
    for name in ("old", "new"):
        scheduler.add(sequence_of(name, 8, new_tokens=8))  # two blocks each: the pool is full
    scheduler.add(sequence_of("late", 2))
    step = scheduler.schedule()
    scheduler.finish_step(step, [1, 1], now=0.0)  # both at position 8: the next token needs a third block
    step = scheduler.schedule()
    assert [s.request.id for s in step.sequences] == ["old"]
    assert [s.request.id for s in scheduler.waiting] == ["new", "late"]
    assert scheduler.waiting[0].preemptions == 1 and scheduler.waiting[0].block_table == []


def test_a_request_the_pool_can_never_hold_is_refused():
    scheduler = Scheduler(BlockManager(2, 4), max_batch=4, max_step_tokens=64)
    with pytest.raises(UserError, match="needs 3 blocks"):
        scheduler.add(sequence_of("big", 9, new_tokens=2))


# ---------------------------------------------------------------- requests and the command line


def test_bad_request_lines_are_reported_by_number_and_the_rest_parse():
    lines = [
        '{"prompt": [1, 2], "max_new_tokens": 3}',
        "not json",
        "",
        '{"prompt": []}',
        '{"prompt": [1], "top_k": -1}',
        '{"prompt": [1], "max_new_tokens": 70}',
        '{"id": "x", "prompt": [1]}',
        '{"id": "x", "prompt": [2]}',
        '{"prompt": [64]}',
        '{"text": "hi"}',
        '{"prompt": [1], "stop_ids": [3, 99]}',
        '{"prompt": [1], "response_format": {"type": "json_object"}}',
    ]
    requests, bad = parse_requests(lines, CONFIG, default_new_tokens=5)
    assert [req.id for req in requests] == ["1", "x"]
    assert [line.line for line in bad] == [2, 4, 5, 6, 8, 9, 10, 11, 12]
    assert "needs --tokenizer" in str(bad[6]) and str(bad[0]).startswith("line 2: not valid JSON")
    needs = "line 12: 'response_format' needs the model's tokenizer (a GGUF file's own, or --tokenizer DIR)"
    assert str(bad[8]) == needs


@pytest.fixture
def weights_file(tmp_path, weights):
    from kvports.formats.weights import save_weights

    path = tmp_path / "model.safetensors"
    save_weights(path, weights, CONFIG)
    return path


def test_batch_cli_reports_bad_lines_by_number_and_runs_the_rest(tmp_path, capsys, weights_file):
    port_or_skip("numpy")
    path = tmp_path / "requests.jsonl"
    path.write_text(
        '{"id": "a", "prompt": [1, 2, 3], "max_new_tokens": 4}\n{"prompt": [1, 2, 999]}\n'
        '{"prompt": [5], "stop_ids": [7], "max_new_tokens": 6}\n{"prompt": "1,2"}\n'
    )
    argv = ["--requests", path, "--framework", "numpy", "--weights", weights_file, "--block-size", 4]
    code, out, err = run_cli(capsys, "batch", *argv)
    assert code == 2
    assert err.splitlines() == [
        "error: line 2: prompt token 999 is outside [0, 64) (vocab_size 64)",
        "error: line 4: 'prompt' must be a list of token ids, got str",
    ]
    lines = [json.loads(line) for line in out.splitlines()]
    assert sorted(line["id"] for line in lines[:-1]) == ["3", "a"]
    summary = lines[-1]["summary"]
    assert (summary["requests"], summary["bad_lines"]) == (2, 2)
    assert summary["blocks"]["free_after"] == summary["blocks"]["num_blocks"]


def test_batch_cli_gives_each_request_its_tokens_alone(tmp_path, capsys, weights, weights_file, port):
    path = tmp_path / "requests.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": req.id, "prompt": list(req.prompt), "max_new_tokens": req.generation.max_new_tokens})
            + "\n"
            for req in ragged_requests()
        )
    )
    argv = ["--requests", path, "--framework", port.NAME, "--weights", weights_file, "--dtype", "float64"]
    code, out, _ = run_cli(capsys, "batch", *argv, "--block-size", 4, "--max-batch", 4)
    assert code == 0
    lines = {line["id"]: line for line in map(json.loads, out.splitlines()[:-1])}
    model = port.load_model(CONFIG, weights, "float64")
    requests = ragged_requests()
    for req in requests:
        alone, _ = generate_alone(port, model, req, requests)  # [1, P + N]
        assert lines[req.id]["tokens"] == alone[0, len(req.prompt) :].tolist()
        assert lines[req.id]["finish_reason"] == "length"


def test_batch_cli_encodes_text_prompts_and_decodes_the_tokens(tmp_path, capsys, weights_file):
    port_or_skip("numpy")
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tokenizer = tokenizers.Tokenizer(WordLevel({f"w{i}": i for i in range(CONFIG.vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    path = tmp_path / "requests.jsonl"
    path.write_text('{"id": "text", "text": "w3 w1 w4"}\n{"id": "ids", "prompt": [3, 1, 4]}\n')
    argv = ["batch", "--requests", str(path), "--framework", "numpy", "--weights", str(weights_file), "--tokenizer",
            str(tmp_path), "--new-tokens", "5"]  # fmt: skip
    code, out, _ = run_cli(capsys, *argv)
    lines = {line["id"]: line for line in map(json.loads, out.splitlines()[:-1])}
    assert code == 0 and lines["text"]["tokens"] == lines["ids"]["tokens"]
    assert lines["text"]["text"] == " ".join(f"w{token}" for token in lines["text"]["tokens"])


def test_a_messages_request_is_the_chat_generate_renders(capsys, chat_model, tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    code, lines, err = run_batch(capsys, chat_model, tmp_path, [{"id": "chat", "messages": messages}])
    assert code == 0, err
    chat_file = tmp_path / "chat.json"
    chat_file.write_text(json.dumps(messages))
    argv = ["generate", "--framework", "numpy", "--mode", "cached", "--weights", chat_model, "--json"]
    code, out, err = run_cli(capsys, *argv, "--chat-file", chat_file, "--new-tokens", "3")
    assert code == 0, err
    alone = json.loads(out)
    prompt = chat_ids(chat_model, messages, gguf_tokenizer(chat_model))
    assert lines[0]["prompt_tokens"] == len(prompt)
    assert alone["tokens"][0] == prompt + lines[0]["tokens"]


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


def test_a_response_format_line_answers_the_json_generate_gives(capsys, chat_model, tmp_path):
    pytest.importorskip("llguidance")
    given = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    line = {"id": "json", "prompt": [5, 6, 7], "max_new_tokens": 20, "response_format": given}
    code, lines, err = run_batch(capsys, chat_model, tmp_path, [line, {"id": "free", "prompt": [5, 6, 7]}])
    assert code == 0, err
    answers = {line["id"]: line for line in lines[:-1]}
    assert set(json.loads(answers["json"]["text"])) == {"n"}
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    argv = ["generate", "--framework", "numpy", "--mode", "cached", "--weights", chat_model, "--json"]
    code, out, err = run_cli(capsys, *argv, "--prompt", "5,6,7", "--new-tokens", "20", "--json-schema", schema)
    assert code == 0, err
    assert json.loads(out)["tokens"][0] == [5, 6, 7] + answers["json"]["tokens"]


@pytest.mark.parametrize(
    "given, message",
    [
        ({"type": "yaml"}, "line 1: 'response_format' type 'yaml' is not one of text, json_object, json_schema"),
        (
            {"type": "json_schema"},
            "line 1: 'response_format' of type json_schema needs 'json_schema': an object with 'name' and 'schema'",
        ),
    ],
)
def test_a_bad_response_format_line_is_refused_by_number_and_the_rest_run(capsys, chat_model, tmp_path, given, message):
    lines = [{"prompt": [5, 6], "response_format": given}, {"prompt": [5, 6]}]
    code, answers, err = run_batch(capsys, chat_model, tmp_path, lines)
    assert code == 2 and err.splitlines() == [f"error: {message}"]
    assert [answer["id"] for answer in answers[:-1]] == ["2"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--requests", "missing.jsonl"], "requests file 'missing.jsonl' does not exist"),
        (["--requests", "{empty}"], "has no requests"),
        (["--requests", "{bad}"], "no request to run in"),
        (["--requests", "{good}", "--max-batch", "0"], "--max-batch 0 is below 1"),
        (["--requests", "{good}", "--block-size", "-1"], "--block-size -1 is below 1"),
        (["--requests", "{good}", "--num-blocks", "0"], "--num-blocks 0 is below 1"),
        (["--requests", "{good}", "--max-step-tokens", "2000000000"], "max step tokens 2000000000 is above"),
        ([], "give --requests FILE.jsonl (or --bench)"),
        (["--requests", "{good}", "--bench"], "give --requests FILE or --bench"),
    ],
)
@pytest.mark.parametrize("framework", ["torch", "jax", "numpy"])
def test_batch_cli_user_errors_are_one_line_for_every_framework(
    tmp_path, capsys, monkeypatch, argv, message, framework
):
    def refuse(name):
        raise AssertionError("no port may load before the inputs are checked")

    monkeypatch.setattr("kvports.registry.load_port", refuse)
    files = {"empty": "\n\n", "bad": '{"prompt": []}\n', "good": '{"prompt": [1]}\n'}
    for name, text in files.items():
        (tmp_path / f"{name}.jsonl").write_text(text)
    argv = [arg.format(**{name: str(tmp_path / f"{name}.jsonl") for name in files}) for arg in argv]
    code, out, err = run_cli(capsys, "batch", "--framework", framework, *argv)
    *bad_lines, last = err.splitlines()  # a file of bad lines reports each, then that nothing is left to run
    assert_one_error_line(code, out, last + "\n")
    assert message in last and all(line.startswith("error: line ") for line in bad_lines)


def test_a_batch_past_the_memory_limit_is_one_error_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVPORTS_MAX_BYTES", "1M")
    (tmp_path / "requests.jsonl").write_text('{"prompt": [1, 2, 3]}\n')
    err = assert_one_error_line(*run_cli(capsys, "batch", "--requests", tmp_path / "requests.jsonl"))
    assert "a batch of 1 requests in float32 would allocate at least" in err and "block pool" in err


def test_batch_bench_runs_both_workloads_and_both_ways_agree(capsys):
    port_or_skip("numpy")
    argv = ["--preset", "seed", "--count", "3", "--frameworks", "numpy", "--json", "--block-size", "4"]
    code, out, _ = run_cli(capsys, "batch", "--bench", *argv)
    assert code == 0
    mixed, prefix = json.loads(out)["rows"]
    assert (mixed["workload"], mixed["same_tokens"]) == ("mixed", 3)  # batched = one at a time, token for token
    assert mixed["speedup"] > 0 and mixed["batched"]["tokens_per_s"] > 0
    assert prefix["same_tokens"] == 3
    assert prefix["with_reuse"]["prefill_tokens"] < prefix["without_reuse"]["prefill_tokens"]


# ---------------------------------------------------------------- JAX: static shapes


def test_each_decode_shape_compiles_once_and_a_few_serve_every_decode_step(weights, monkeypatch):
    """A decode step runs in a rung of rows and of blocks a row (jax_impl/paged.py's decode_sizes):
    4 rows that finish one by one over 12 blocks take rows 4 then 1 and blocks 8 then 12, each
    shape traced at its first step only."""
    jax_port = port_or_skip("jax")
    from kvports.jax_impl import paged
    from tests.helpers.compiles import counting_traces

    jax_port.clear_compiled()
    model = jax_port.load_model(CONFIG, weights, "float32")
    engine = Engine(jax_port, model, CONFIG, SETTINGS)
    # 4 rows (max_batch) that finish at different steps; the first grows past 8 blocks, the last ends alone
    longer = request("long", range(30), 16)
    for req in [longer, *ragged_requests()[1:4]]:
        engine.add(req)
    shapes: list[tuple[int, int]] = []  # each step's [B, T] and [B, M], as the engine passes them
    stepping = jax_port.paged_step

    def recording(model, pool, tokens, start, block_tables, *args, **kwargs):
        shapes.append((tokens.shape, block_tables.shape))
        return stepping(model, pool, tokens, start, block_tables, *args, **kwargs)

    monkeypatch.setattr(jax_port, "paged_step", recording)
    traced_at: dict[tuple[int, int], list[int]] = {}  # each decode program's (rows, blocks): its steps' traces
    while not engine.idle:
        with counting_traces() as step_traces:
            engine.step()
        (B, T), (_, M) = shapes[-1]
        if T == 1:
            rows = paged.step_shape(SETTINGS.max_batch, B, T)[0]
            traced_at.setdefault((rows, paged.step_blocks(engine.pool.max_blocks, M, T)), []).append(len(step_traces))
    assert {rows for rows, _ in traced_at} == {1, 4} and {blocks for _, blocks in traced_at} == {8, 12}, traced_at
    for shape, traces in traced_at.items():
        assert traces[0] > 0 and traces[1:] == [0] * (len(traces) - 1), (shape, traces)


@pytest.mark.parametrize(
    ("B", "M", "rows", "blocks"),
    [(1, 1, 1, 8), (2, 8, 4, 8), (4, 9, 4, 32), (5, 32, 16, 32), (6, 33, 16, 64), (16, 64, 16, 64)],
)
def test_a_decode_step_runs_in_the_least_rungs_of_rows_and_blocks_that_hold_it(B, M, rows, blocks):
    """16 rows of 64 blocks at most: rows 1, 4, 16; blocks a row 8, 32, 64 (the largest always a rung)."""
    port_or_skip("jax")
    from kvports.jax_impl import paged

    assert paged.step_shape(16, B, 1) == (rows, (1,))
    assert paged.step_blocks(64, M, 1) == blocks


@pytest.mark.parametrize(("T", "every_position"), [(1, True), (2, False), (40, False)])
def test_a_prefill_step_runs_over_every_block_a_row_may_have(T, every_position):
    port_or_skip("jax")
    from kvports.jax_impl import paged

    assert paged.step_blocks(64, 3, T, every_position) == 64


def test_an_engine_flattens_its_model_once_for_every_step(weights, monkeypatch):
    """Flattening an nnx model (and eval()) cost ~35 ms a step on SmolLM2, more than its step's program."""
    jax_port = port_or_skip("jax")
    from kvports.jax_impl import split

    flattened = []
    splitting = split.split_model
    monkeypatch.setattr(split, "split_model", lambda model: flattened.append(model) or splitting(model))
    model = jax_port.load_model(CONFIG, weights, "float32")
    engine, finished = run_engine(jax_port, model, ragged_requests()[:3])
    assert engine.stats.steps["decode"] > 5 and len(finished) == 3
    assert flattened == [model]


def test_a_step_donates_the_block_pool(weights):
    jax_port = port_or_skip("jax")
    model = jax_port.load_model(CONFIG, weights, "float32")
    pool = jax_port.init_block_pool(model, num_blocks=8, block_size=4, max_batch=2, max_blocks=4)
    tokens, start, tables = np.array([[5, 9, 2]]), np.array([0]), np.array([[0]])
    greedy = RowSampling.of([GenerationConfig(1)], np.zeros(1))
    _, new_pool, _ = jax_port.paged_step(model, pool, tokens, start, tables, greedy)
    assert pool.keys.is_deleted() and pool.values.is_deleted()  # XLA wrote the blocks in place
    assert not new_pool.keys.is_deleted()
