"""What every port's generation loops promise whatever the model's numbers or the batch's
makeup: a forward that overflows stops the run at the step it overflowed, named the same in
every port and mode; a sampled row's draws depend on its seed, never on its place in the
batch; and the batching engine samples any mix of settings with one compiled program."""

from __future__ import annotations

import numpy as np
import pytest

import kvports
from kvports.batching.engine import BatchSettings, Engine
from kvports.batching.request import Request
from kvports.formats.weights import save_weights
from kvports.shared.config import ModelConfig
from kvports.shared.errors import NonFiniteLogits, UserError
from kvports.shared.generation import GenerationConfig, pad_prompts, row_tokens
from tests.helpers.commands import assert_one_error_line, run_cli
from tests.helpers.models import random_weights

# Learned positions (an overflow can be placed at one), RMSNorm (no mean subtracted: a dimension
# that is 0 in the residual stream is 0 after the norm), untied head: small enough for float64.
CONFIG = ModelConfig(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, max_seq_len=64, norm="rmsnorm")
OVERFLOW_AT = 7  # the position whose logits overflow float32
# Row 1 is 5 tokens long: position 7 is the token its step 2 makes, whose logits choose step 3.
# Row 0, one shorter, gets there a step later: the error names step 3 and row 1.
PROMPTS = pad_prompts([[5, 9, 2, 40], [11, 3, 8, 1, 7]])[0]  # [2, 5]
OVERFLOW = "step 3 produced a non-finite logit (row 1): the forward pass overflowed at float32; try --dtype float64"
SETTINGS = BatchSettings(max_batch=4, block_size=4, max_step_tokens=64, max_length=48)


@pytest.fixture(scope="module")
def overflowing():
    """Finite weights whose logits at position OVERFLOW_AT are about 5.5e38, past float32's
    largest (3.4e38) and far inside float64's. The overflow is in the head, so it never feeds
    back into another position (a NaN in attention would reach them all through 0 * NaN): every
    mode sees it at the same step. Dimension 0 of the residual stream is 0 everywhere but there
    (1000), and every head row reads it with weight 1e38: elsewhere the logits are the model's own."""
    weights = random_weights(CONFIG, seed=3)
    for name in ("emb.weight", "pos.weight"):
        weights[name][:, 0] = 0
    for layer in range(CONFIG.n_layers):
        for name in ("proj", "ffn.2"):  # no block writes dimension 0
            weights[f"blocks.{layer}.{name}.weight"][0] = 0
            weights[f"blocks.{layer}.{name}.bias"][0] = 0
    weights["pos.weight"][OVERFLOW_AT] = 1000 * np.eye(CONFIG.d_model)[0]
    weights["ln.weight"][0] = 1
    weights["head.weight"][:, 0] = 1e38
    return weights


@pytest.fixture(scope="module")
def weights():
    return random_weights(CONFIG, seed=3)


def run(port, model, prompts, generation, mode, on_token=None):
    if mode == "speculative":
        return port.generate_speculative(model, None, prompts, generation, 3, on_token=on_token)[0]
    return port.generate(model, prompts, generation, mode, on_token=on_token)[0]


@pytest.mark.parametrize("mode", ["naive", "cached", "speculative"])
def test_an_overflowing_forward_stops_the_run_at_its_step_in_every_port(port, overflowing, mode):
    model = port.load_model(CONFIG, overflowing, "float32")
    with pytest.raises(NonFiniteLogits) as error:
        run(port, model, PROMPTS, 10, mode)
    assert str(error.value) == OVERFLOW


@pytest.mark.parametrize("mode", ["naive", "cached", "speculative"])
def test_the_same_weights_run_at_float64(port, overflowing, mode):
    tokens = run(port, port.load_model(CONFIG, overflowing, "float64"), PROMPTS, 10, mode)
    assert tokens.shape == (2, 15)


@pytest.mark.parametrize("mode", ["naive", "cached", "speculative"])
def test_a_stream_hears_no_token_from_an_overflowed_step(port, overflowing, mode):
    heard = []
    with pytest.raises(NonFiniteLogits):
        run(port, port.load_model(CONFIG, overflowing, "float32"), PROMPTS, 10, mode, heard.append)
    assert len(heard) == 3  # steps 0, 1 and 2


def test_the_batching_engine_stops_at_the_request_and_step_that_overflowed(port, overflowing):
    engine = Engine(port, port.load_model(CONFIG, overflowing, "float32"), CONFIG, SETTINGS)
    engine.add(Request("short", (5, 9, 2, 40), GenerationConfig(10)))
    engine.add(Request("long", (11, 3, 8, 1, 7), GenerationConfig(10)))
    with pytest.raises(NonFiniteLogits) as error:
        engine.run()
    assert str(error.value) == OVERFLOW.replace("row 1", "request 'long'")


def test_an_overflow_is_one_error_line_on_the_command_line(port, overflowing, tmp_path, capsys):
    weights_file = tmp_path / "overflowing.safetensors"
    save_weights(weights_file, overflowing, CONFIG)
    prompts = ["--prompt", "5,9,2,40", "--prompt", "11,3,8,1,7"]
    code, out, err = run_cli(
        capsys, "generate", "--framework", port.NAME, "--mode", "cached", "--weights", weights_file, *prompts,
        "--new-tokens", 10, "--no-stop",
    )  # fmt: skip
    assert assert_one_error_line(code, out, err) == f"error: {OVERFLOW}\n"


def test_the_api_names_its_own_dtype_argument_for_an_overflow(port, overflowing, tmp_path):
    weights_file = tmp_path / "overflowing.safetensors"
    save_weights(weights_file, overflowing, CONFIG)
    model = kvports.load(port.NAME, weights_file)
    with pytest.raises(UserError) as error:
        model.generate([[5, 9, 2, 40], [11, 3, 8, 1, 7]], new_tokens=10, stop_ids=[])
    assert str(error.value) == OVERFLOW.replace("--dtype float64", "dtype='float64'")


# ---------------------------------------------------------------- a row's draws are its seed's


SAMPLED = GenerationConfig(12, temperature=0.9, top_k=20, seed=1)


@pytest.mark.parametrize("mode", ["naive", "cached", "speculative"])
def test_a_sampled_row_gets_the_tokens_it_gets_alone_wherever_it_sits(port, weights, mode):
    model = port.load_model(CONFIG, weights, "float64")
    alone = run(port, model, np.array([[7, 8, 9, 10, 11]]), SAMPLED, mode)
    second = run(port, model, pad_prompts([[1, 2, 3], [7, 8, 9, 10, 11]])[0], SAMPLED, mode)
    assert row_tokens(second)[1] == row_tokens(alone)[0]


def test_per_row_seeds_give_each_row_its_own_seeds_tokens(port, weights):
    model = port.load_model(CONFIG, weights, "float64")
    prompt = [7, 8, 9, 10, 11]
    rows = run(port, model, np.array([prompt, prompt]), GenerationConfig(12, temperature=0.9, seeds=(4, 1)), "cached")
    for row, seed in zip(rows, (4, 1), strict=True):
        alone = run(port, model, np.array([prompt]), GenerationConfig(12, temperature=0.9, seed=seed), "cached")
        assert row.tolist() == alone[0].tolist()


def test_num_samples_repeats_each_prompt_with_the_next_seeds(port):
    model = kvports.load(port.NAME, dtype="float64")
    out = model.generate([[7, 8, 9], [1, 2]], new_tokens=6, temperature=0.9, seed=3, num_samples=2)
    expected = [
        model.generate([prompt], new_tokens=6, temperature=0.9, seed=seed).generated[0]
        for prompt, seed in [([7, 8, 9], 3), ([7, 8, 9], 4), ([1, 2], 3), ([1, 2], 4)]
    ]
    assert out.generated == expected


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--seed", "1,2,3"],
            "error: --seed [1, 2, 3] gives 3 seeds for 2 prompts: give one seed, or one per prompt\n",
        ),
        (["--num-samples", "1025"], "error: --num-samples 1025 is above 1024\n"),
        (["--num-samples", "0"], "error: --num-samples 0 is below 1\n"),
        (
            ["--seed", str(2**64 - 1), "--num-samples", "2"],
            f"error: --num-samples 2 takes the seed to {2**64}, above {2**64 - 1}\n",
        ),
    ],
    ids=["seed-count", "too-many-samples", "no-samples", "seed-past-64-bits"],
)
def test_seed_lists_and_sample_counts_are_checked_before_any_port_loads(capsys, no_port_may_load, flags, message):
    prompts = ["--prompt", "7,8,9", "--prompt", "1,2"]
    code, out, err = run_cli(capsys, "generate", "--framework", "numpy", "--mode", "cached", *prompts, *flags)
    assert assert_one_error_line(code, out, err) == message


def test_the_api_names_its_own_argument_for_a_bad_sample_count():
    with pytest.raises(UserError, match=r"^num_samples=0 is below 1$"):
        kvports.load("numpy").generate([1, 2], new_tokens=2, temperature=0.9, num_samples=0)


def test_a_batch_request_gets_the_tokens_its_prompt_and_seed_get_in_any_row_of_generate(port, weights):
    model = port.load_model(CONFIG, weights, "float64")
    engine = Engine(port, model, CONFIG, SETTINGS)
    settings = [dict(temperature=0.9, seed=1), dict(temperature=0.7, top_p=0.8, seed=1), dict(temperature=1.3, seed=2)]
    requests = [Request(str(i), (7, 8, 9, 10, 11), GenerationConfig(8, **s)) for i, s in enumerate(settings)]
    for req in requests:
        engine.add(req)
    batched = {sequence.request.id: sequence.generated for sequence in engine.run()}
    for req in requests:
        second = port.generate(model, pad_prompts([[1, 2, 3], req.prompt])[0], req.generation, "cached")[0]
        assert batched[req.id] == second[1, 5:].tolist(), req.id


# ---------------------------------------------------------------- speculative streaming


def test_a_speculative_stream_ends_where_every_row_stopped_in_every_port(port, reference, weights):
    """Rows that stop early: the stream hears as many steps in every port (the reference's count)."""
    prompts = np.array([[7, 8, 9, 10, 11], [1, 2, 3, 4, 5]])
    plain = run(reference, reference.load_model(CONFIG, weights, "float64"), prompts, 20, "cached")
    stops = tuple(int(token) for token in plain[:, 8])  # each row stops at its fourth new token
    generation = GenerationConfig(20, stop_ids=stops)

    def heard(module):
        calls = []
        run(module, module.load_model(CONFIG, weights, "float64"), prompts, generation, "speculative", calls.append)
        return len(calls)

    assert heard(port) == heard(reference) < 20


def test_a_sampled_draft_that_overflows_stops_the_run_at_its_step(port, weights, overflowing):
    """The draft's probabilities decide which proposals stay and what is drawn at a rejection:
    NaN there would be noise in the target's own output."""
    model, draft = port.load_model(CONFIG, weights, "float32"), port.load_model(CONFIG, overflowing, "float32")
    sampled = GenerationConfig(10, temperature=0.9, seed=2)
    with pytest.raises(NonFiniteLogits) as error:
        port.generate_speculative(model, draft, PROMPTS, sampled, 3)
    assert str(error.value) == OVERFLOW
