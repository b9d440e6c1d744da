"""Every port satisfies shared.contract.Port and every baseline shared.contract.Baseline: the
names, the parameters (named, placed and defaulted as the Protocol says) and on_token's
behaviour; and the checker itself catches what it should."""

from __future__ import annotations

import importlib
import inspect
import types

import numpy as np
import pytest

from kvports.registry import MODULES, PORTS
from kvports.shared import contract
from tests.helpers.models import SEED_PROMPT

BASELINES = ("seed_concat", "hf_transformers", "torch_compile", "llama_cpp", "ctranslate2")


def import_or_skip(module_name: str) -> types.ModuleType:
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        pytest.skip(f"{module_name} needs a missing package ({exc})")


@pytest.mark.parametrize("name", PORTS)
def test_port_satisfies_the_port_protocol(name):
    port = import_or_skip(MODULES[name])
    assert contract.mismatches(port, contract.Port) == []
    assert port.NAME == name


@pytest.mark.parametrize("name", BASELINES)
def test_baseline_satisfies_the_baseline_protocol(name):
    baseline = import_or_skip(f"kvports.baselines.{name}")
    assert contract.mismatches(baseline, contract.Baseline) == []


@pytest.mark.parametrize("mode", ["naive", "cached"])
def test_on_token_reports_each_token_as_generate_returns_it(port, seed_weights, mode):
    config, tensors = seed_weights
    model = port.load_model(config, tensors)
    prompts = np.concatenate([SEED_PROMPT, SEED_PROMPT[:, ::-1]])  # [2, 5]
    streamed = []
    tokens, _ = port.generate(model, prompts, 3, mode, on_token=streamed.append)
    expected, _ = port.generate(model, prompts, 3, mode)
    np.testing.assert_array_equal(tokens, expected)
    assert len(streamed) == 3 and all(token.shape == (2,) for token in streamed)
    np.testing.assert_array_equal(np.stack(streamed, axis=1), expected[:, 5:])


# ---------------------------------------------------------------- the checker


def conforming_port() -> types.ModuleType:
    """A stand-in module named `fake` with every Port name, each call with the Protocol's own signature."""
    module = types.ModuleType("fake")
    for name, signature in contract.members(contract.Port).items():
        if signature is None:
            setattr(module, name, "fake")
        else:

            def call(*args, **kwargs):
                return None

            call.__signature__ = signature
            setattr(module, name, call)
    return module


def with_signature(text: str):
    namespace: dict = {}
    exec(f"def call{text}: pass", namespace)
    return namespace["call"]


def test_the_protocol_itself_conforms():
    assert contract.mismatches(conforming_port(), contract.Port) == []


def test_a_missing_name_is_reported():
    port = conforming_port()
    del port.forward_chunks
    assert contract.mismatches(port, contract.Port) == ["fake has no forward_chunks"]


@pytest.mark.parametrize(
    "signature, problem",
    [
        ("(model, tokens, sizes)", "parameter 3 must be 'chunk_sizes'"),
        ("(model, chunk_sizes, tokens)", "parameter 2 must be 'tokens'"),
        ("(model, tokens)", "parameter 3 must be 'chunk_sizes'"),
        ("(model, tokens, chunk_sizes, extra)", "extra parameter 'extra' needs a default"),
    ],
)
def test_a_call_a_caller_could_not_make_is_reported(signature, problem):
    port = conforming_port()
    port.forward_chunks = with_signature(signature)
    found = contract.mismatches(port, contract.Port)
    assert found and found[0].startswith(f"fake.forward_chunks: {problem}"), found


def test_a_different_default_is_reported():
    port = conforming_port()
    port.load_model = with_signature(
        "(config, tensors, dtype='float64', device='cpu', *, quant='none', tensor_parallel=1)"
    )
    assert contract.mismatches(port, contract.Port) == [
        "fake.load_model: dtype must default to 'float32' (found 'float64')"
    ]


def test_a_port_that_cannot_split_its_model_is_reported():
    port = conforming_port()
    port.load_model = with_signature("(config, tensors, dtype='float32', device='cpu', *, quant='none')")
    assert contract.mismatches(port, contract.Port) == ["fake.load_model: has no keyword parameter 'tensor_parallel'"]


def test_an_extra_parameter_with_a_default_and_a_keyword_only_on_token_conform():
    baseline = conforming_port()
    baseline.MODES = ("cached",)
    # A baseline's generate may take more (prefill) as long as on_token is still a keyword.
    baseline.generate = with_signature(
        "(model, prompts, new_tokens, mode='cached', return_logits=False, prefill=True, on_token=None)"
    )
    assert contract.mismatches(baseline, contract.Baseline) == []


def test_members_lists_the_port_contract_in_order():
    assert list(contract.members(contract.Port)) == [
        "NAME",
        "versions",
        "load_model",
        "generate",
        "synchronize",
        "matvec_seconds",
        "resolve_device",
        "device_count",
        "linear_route",
        "generate_speculative",
        "forward_chunks",
        "clear_compiled",
        "init_block_pool",
        "paged_step",
        "compile_paged_steps",
    ]
    assert str(contract.members(contract.Port)["generate"]).startswith(
        "(model: 'Model', prompts: 'np.ndarray', generation: 'int | GenerationConfig', mode: 'str', return_logits: "
        "'bool' = False, "
        "prefill: 'bool' = True, on_token:"
    )
    assert inspect.Parameter.KEYWORD_ONLY == contract.members(contract.Baseline)["generate"].parameters["on_token"].kind
