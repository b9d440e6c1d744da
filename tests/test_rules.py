"""The run's refusal rules, one table, against every command that takes their inputs: `kvports
generate`, `compare`, `bench`, `batch`, `batch --bench` (the batching bench), `serve`, `check` and the Python
API (`kvports.load(...)`, then `Model.generate(...)`). Each refusal is one `error:` line, exit 2,
the same line in every command (the API: the same words, naming its arguments), and comes before
any port is imported (or, for what only an imported port can tell, before any model loads).

A command that does not take a rule's inputs is skipped for it here, by name and with the reason;
`test_a_skip_is_a_command_without_the_rules_flag` holds each "takes no --flag" to the command's
parser, so a rule cannot quietly exist in one command only."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

import kvports
from kvports import cli, registry
from kvports.formats.weights import DEFAULT_WEIGHTS, gpt2_init_weights, save_weights
from kvports.shared.config import ModelConfig
from kvports.shared.errors import echo_path
from tests.helpers.commands import assert_one_error_line, run_cli
from tests.helpers.ports import port_or_skip

DRAFT_CONFIG = ModelConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=1, max_seq_len=128)
API = "kvports.load"
LOAD_ARGUMENTS = ("weights", "dtype", "device", "quant", "tensor_parallel")  # load()'s; the rest are generate()'s


@dataclass(frozen=True)
class Command:
    """How one command takes a rule's inputs: argv before them, and each input's flag."""

    argv: tuple[str, ...]
    flags: dict[str, str]
    modes: Callable[[str], str] = lambda mode: mode  # the --mode/--modes value that runs `mode`
    defaults: tuple[tuple[str, str], ...] = ()  # what a rule that does not name them runs with


COMMON = {"dtype": "--dtype", "quant": "--quant", "device": "--device", "tensor_parallel": "--tensor-parallel"}
COMMANDS = {
    "generate": Command(
        ("generate", "--new-tokens", "2"),
        {"framework": "--framework", "mode": "--mode", **COMMON, "draft": "--draft", "logprobs": "--logprobs"},
        defaults=(("mode", "cached"),),
    ),
    # compare's reference is a naive or cached row: a speculative row comes with a cached one
    "compare": Command(
        ("compare", "--new-tokens", "2", "--repeats", "1"),
        {"framework": "--frameworks", "mode": "--modes", **COMMON, "draft": "--draft"},
        lambda mode: "cached,speculative" if mode == "speculative" else mode,
    ),
    "bench": Command(
        ("bench", "--new-tokens", "2", "--repeats", "1"),
        {"framework": "--frameworks", "mode": "--modes", **COMMON, "draft": "--draft"},
    ),
    "batch": Command(("batch", "--requests", "{requests}"), {"framework": "--framework", **COMMON}),
    "batch --bench": Command(
        ("batch", "--bench", "--preset", "seed", "--count", "2"), {"framework": "--frameworks", **COMMON}
    ),
    "serve": Command(
        ("serve",), {"framework": "--framework", "dtype": "--dtype", "quant": "--quant", "device": "--device"}
    ),
    "check": Command(("check", "{implementation}"), {}),
    "chat": Command(
        ("chat", "--new-tokens", "2"),
        {"framework": "--framework", **{key: flag for key, flag in COMMON.items() if key != "tensor_parallel"}},
    ),
}
EVERY_COMMAND = (*COMMANDS, API)


@dataclass(frozen=True)
class Rule:
    """The inputs (framework, mode, dtype, quant, device, tensor_parallel, draft, logprobs), the command
    line's whole message and the API's; `skip`: command -> why it is not run; `own`: command -> the
    line it refuses the inputs with instead (an input it takes only elsewhere); `imports`: the rule
    needs an imported port (a GPU, the device count), so only the models must not load before it."""

    given: dict[str, Any]
    line: str
    api: str
    skip: dict[str, str] = field(default_factory=dict)
    own: dict[str, str] = field(default_factory=dict)
    imports: bool = False
    prepare: Callable[[pytest.MonkeyPatch], None] = lambda monkeypatch: None


def takes_no(*flags: str) -> str:
    return "takes no " + " or ".join(flags)


CHECK = takes_no("--dtype", "--quant", "--device", "--tensor-parallel", "--mode", "--draft", "--logprobs")
CHECK_SKIP = {"check": CHECK + ": its reference runs the seed's model at float32 and float64 on the CPU"}
FLOAT_WEIGHTS = "--bench times float weights; --quant {quant} is for --requests FILE"
ONE_DEVICE = "--bench times one device; --tensor-parallel {tensor_parallel} is for --requests FILE"
BENCH_SPLITS = "gives a split beyond the devices rows that say why: --tensor-parallel takes a list (docs/BENCH.md)"
NO_DRAFT = {
    "batch": takes_no("--draft"),
    "batch --bench": takes_no("--mode", "--draft"),
}


def without_gpu(framework: str) -> Callable[[pytest.MonkeyPatch], None]:
    def prepare(monkeypatch: pytest.MonkeyPatch) -> None:
        port = port_or_skip(framework)
        real = port.resolve_device

        def refuse(device: str) -> Any:
            if device == "gpu":
                raise RuntimeError(f"{framework} finds no GPU")
            return real(device)

        monkeypatch.setattr(port, "resolve_device", refuse)

    return prepare


def one_jax_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(port_or_skip("jax"), "device_count", lambda device: 1)


def numpy_without_speculative(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        registry.MODES, "numpy", tuple(mode for mode in registry.MODES["numpy"] if mode != "speculative")
    )


RULES = {
    "quant_with_tensor_parallel": Rule(
        {"framework": "jax", "quant": "int8", "tensor_parallel": 2},
        "--quant int8 runs on one device: give it without --tensor-parallel 2",
        "quant='int8' runs on one device: give it without tensor_parallel=2",
        CHECK_SKIP,
        {"batch --bench": FLOAT_WEIGHTS},
    ),
    "quant_over_float64": Rule(
        {"framework": "torch", "dtype": "float64", "quant": "int8"},
        "--quant int8 needs float32 or bfloat16 activations, not --dtype float64: quantized weights have no "
        "float64 digits",
        "quant='int8' needs float32 or bfloat16 activations, not dtype='float64': quantized weights have no "
        "float64 digits",
        CHECK_SKIP,
        {"batch --bench": FLOAT_WEIGHTS},
    ),
    "dtype_a_port_lacks": Rule(
        {"framework": "numpy", "dtype": "bfloat16"},
        "--dtype bfloat16 is offered by torch, jax only, where the framework has a fast bfloat16 product",
        "dtype='bfloat16' is offered by torch, jax only, where the framework has a fast bfloat16 product",
        CHECK_SKIP,
    ),
    "quant_a_port_lacks": Rule(
        {"framework": "numpy", "quant": "int8"},
        "--quant int8 is offered by torch, jax only, where the framework has a fast int8 product",
        "quant='int8' is offered by torch, jax only, where the framework has a fast int8 product",
        CHECK_SKIP,
        {"batch --bench": FLOAT_WEIGHTS},
    ),
    "mode_a_port_lacks": Rule(
        {"framework": "numpy", "mode": "speculative", "draft": "ngram"},
        "--mode speculative is offered by torch, jax only: numpy has no speculative mode",
        "mode='speculative' is offered by torch, jax only: numpy has no speculative mode",
        {**CHECK_SKIP, **NO_DRAFT, "batch": takes_no("--mode", "--draft")},
        prepare=numpy_without_speculative,
    ),
    "torch_quant_on_a_gpu": Rule(
        {"framework": "torch", "quant": "q4", "device": "gpu"},
        "--quant q4 runs on the CPU in torch (its packed q4 product is a CPU kernel): give it without --device gpu",
        "quant='q4' runs on the CPU in torch (its packed q4 product is a CPU kernel): give it without device='gpu'",
        {
            **CHECK_SKIP,
            "bench": "runs torch's baselines beside its rows, on the GPU at float weights: the q4 rows say why "
            "they are missing (its port_problems imports torch to ask for the GPU)",
        },
        {"batch --bench": FLOAT_WEIGHTS},
    ),
    "numpy_on_a_gpu": Rule(
        {"framework": "numpy", "device": "gpu"},
        "--device gpu: numpy runs on the CPU only",
        "device='gpu': numpy runs on the CPU only",
        CHECK_SKIP,
    ),
    "no_gpu": Rule(
        {"framework": "torch", "device": "gpu"},
        "--device gpu: torch finds no GPU",
        "device='gpu': torch finds no GPU",
        CHECK_SKIP,
        imports=True,
        prepare=without_gpu("torch"),
    ),
    "tensor_parallel_on_numpy": Rule(
        {"framework": "numpy", "tensor_parallel": 2},
        "numpy has no tensor parallelism; --tensor-parallel 2 needs torch or jax",
        "numpy has no tensor parallelism; tensor_parallel=2 needs torch or jax",
        CHECK_SKIP,
        {"batch --bench": ONE_DEVICE},
    ),
    "tensor_parallel_that_does_not_divide_the_heads": Rule(
        {"framework": "jax", "tensor_parallel": 3},
        "--tensor-parallel 3 must divide the model's query heads (n_heads 4) and its FFN width (ffn_dim 512): "
        "each device takes whole heads and an equal slice of the FFN",
        "tensor_parallel=3 must divide the model's query heads (n_heads 4) and its FFN width (ffn_dim 512): "
        "each device takes whole heads and an equal slice of the FFN",
        CHECK_SKIP,
        {"batch --bench": ONE_DEVICE},
    ),
    "tensor_parallel_above_the_bound": Rule(
        {"framework": "jax", "tensor_parallel": 65},
        "--tensor-parallel 65 is above 64",
        "tensor_parallel=65 is above 64",
        CHECK_SKIP,
        {"batch --bench": ONE_DEVICE},
    ),
    "more_devices_than_there_are": Rule(
        {"framework": "jax", "tensor_parallel": 2},
        "--tensor-parallel 2 is above the 1 cpu devices here (JAX had started with fewer before kvports could "
        "ask for more)",
        "tensor_parallel=2 is above the 1 cpu devices here (JAX had started with fewer before kvports could "
        "ask for more)",
        {**CHECK_SKIP, "bench": BENCH_SPLITS},
        {"batch --bench": ONE_DEVICE},
        imports=True,
        prepare=one_jax_device,
    ),
    "a_split_paged_cache": Rule(
        {"framework": "torch", "tensor_parallel": 2},
        "--tensor-parallel 2 in batch runs on jax only: torch's ranks have no paged cache",
        "",
        {
            **CHECK_SKIP,
            "generate": "runs no paged cache: torch splits its generate",
            "compare": "runs no paged cache: torch splits its generate",
            "bench": "runs no paged cache: torch splits its generate",
            API: "runs no paged cache: torch splits its generate",
        },
        {"batch --bench": ONE_DEVICE},
    ),
    "a_draft_with_another_vocabulary": Rule(
        {"framework": "numpy", "mode": "speculative", "draft": "{draft}"},
        "the draft's vocab_size 64 differs from the model's 500: a draft must propose the target's tokens",
        "the draft's vocab_size 64 differs from the model's 500: a draft must propose the target's tokens",
        {**CHECK_SKIP, **NO_DRAFT},
    ),
    "q4_without_4_bit_blocks": Rule(
        {"framework": "torch", "quant": "q4"},
        f"--quant q4 needs a GGUF file with Q4_0 or Q4_1 matrices; {echo_path(DEFAULT_WEIGHTS)} has none",
        f"quant='q4' needs a GGUF file with Q4_0 or Q4_1 matrices; {echo_path(DEFAULT_WEIGHTS)} has none",
        CHECK_SKIP,
        {"batch --bench": FLOAT_WEIGHTS},
    ),
    "logprobs_with_speculative": Rule(
        {"framework": "numpy", "mode": "speculative", "draft": "ngram", "logprobs": 2},
        "--logprobs 2 needs --mode naive or cached: speculative decoding verifies proposals in rounds and keeps "
        "no step's logits",
        "logprobs=2 needs mode='naive' or 'cached': speculative decoding verifies proposals in rounds and keeps "
        "no step's logits",
        {
            **CHECK_SKIP,
            "compare": takes_no("--logprobs"),
            "bench": takes_no("--logprobs"),
            "batch": takes_no("--mode", "--draft", "--logprobs"),
            "batch --bench": takes_no("--mode", "--draft", "--logprobs"),
        },
    ),
}
# chat answers in its one cached loop, serve with the engine's paged steps, each on one device: a rule
# about flags such a command lacks skips it there
ONE_MODEL_ON_ONE_DEVICE = {
    "mode": "--mode",
    "draft": "--draft",
    "tensor_parallel": "--tensor-parallel",
    "logprobs": "--logprobs",
}
for _name, _rule in RULES.items():
    _lacking = [flag for key, flag in ONE_MODEL_ON_ONE_DEVICE.items() if key in _rule.given]
    if _lacking:
        RULES[_name] = replace(_rule, skip={**_rule.skip, "chat": takes_no(*_lacking), "serve": takes_no(*_lacking)})
PAIRS = [(rule, command) for rule in RULES for command in EVERY_COMMAND]


@pytest.fixture
def files(tmp_path) -> dict[str, str]:
    """What the inputs name: a draft model with another vocabulary, a requests file, an implementation."""
    draft = tmp_path / "draft.safetensors"
    save_weights(draft, gpt2_init_weights(DRAFT_CONFIG), DRAFT_CONFIG)
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"prompt": [1, 2, 3]}\n')
    implementation = tmp_path / "implementation.py"
    implementation.write_text("raise SystemExit('a checked implementation must not be imported')\n")
    return {"draft": str(draft), "requests": str(requests), "implementation": str(implementation)}


def fill(value: Any, files: dict[str, str]) -> Any:
    return value.format(**files) if isinstance(value, str) else value


def argv_of(command: Command, given: dict[str, Any], files: dict[str, str]) -> list[str]:
    argv = [fill(part, files) for part in command.argv]
    for name, value in {**dict(command.defaults), **given}.items():
        argv += [command.flags[name], command.modes(value) if name == "mode" else str(fill(value, files))]
    return argv


def models_must_not_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every installed port's load_model (the model's, and a draft's) fails the test if called."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a model was loaded before the inputs were checked")

    for name in registry.PORTS:
        port = registry.available_port(name)
        if port is not None:
            monkeypatch.setattr(port, "load_model", refuse)


@pytest.mark.parametrize("rule_name, command", PAIRS, ids=[f"{rule}-{command}" for rule, command in PAIRS])
def test_a_rule_is_the_same_one_line_refusal_in_every_command_before_anything_loads(
    request, capsys, monkeypatch, files, rule_name, command
):
    rule = RULES[rule_name]
    if command in rule.skip:
        pytest.skip(f"{command} {rule.skip[command]}")
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # a split asks JAX for simulated devices
    rule.prepare(monkeypatch)
    given = {name: fill(value, files) for name, value in rule.given.items()}
    model = None
    if command == API and not set(given) & set(LOAD_ARGUMENTS):
        model = kvports.load(given["framework"])  # what generate() is called on, loaded before the guards
    models_must_not_load(monkeypatch)
    if not rule.imports:
        request.getfixturevalue("no_port_may_load")
    if command == API:
        loads = {name: value for name, value in given.items() if name in LOAD_ARGUMENTS}
        calls = {name: value for name, value in given.items() if name not in loads and name != "framework"}
        with pytest.raises(kvports.UserError) as refusal:
            if model is None:
                model = kvports.load(given["framework"], **loads)
            model.generate([1, 2, 3], new_tokens=2, **calls)
        assert str(refusal.value) == rule.api
        return
    err = assert_one_error_line(*run_cli(capsys, *argv_of(COMMANDS[command], given, files)))
    expected = rule.own.get(command, rule.line).format(**given)
    assert err == f"error: {expected}\n"


def command_flags(command: str) -> set[str]:
    """The flags of the command's own parser."""
    cli.build_parser()
    parser = cli.COMMAND_PARSERS[command.split()[0]]
    return {flag for action in parser._actions for flag in action.option_strings}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_flag_a_command_takes_here_is_one_of_its_own(command):
    assert set(COMMANDS[command].flags.values()) <= command_flags(command)


@pytest.mark.parametrize("rule_name, command", PAIRS, ids=[f"{rule}-{command}" for rule, command in PAIRS])
def test_a_skip_is_a_command_without_the_rules_flag(rule_name, command):
    """A command that takes every input of a rule runs it; 'takes no --flag' must be true of the
    command (its flags above, and its parser: batch's also holds the --requests flags --bench
    refuses); any other skip is a rule the command has no part in, which refuses elsewhere."""
    rule = RULES[rule_name]
    reason = rule.skip.get(command)
    inputs = {name for name in rule.given if name != "framework"}
    lacking = set() if command == API else inputs - set(COMMANDS[command].flags)
    if reason is None:
        assert not lacking, f"{command} takes no {lacking}: skip it, or give it the flag"
        return
    if not reason.startswith("takes no "):
        assert any(other not in rule.skip for other in EVERY_COMMAND)
        return
    named = {word.rstrip(":,") for word in reason.split() if word.startswith("--")}
    assert lacking and named, f"{command} takes every input of {rule_name}: it must refuse, not be skipped"
    assert not named & set(COMMANDS[command].flags.values())
    if command != "batch --bench":
        assert not named & command_flags(command), f"{command}'s parser has {named & command_flags(command)}"


def test_a_bench_split_beyond_the_devices_is_rows_with_the_rules_line(capsys, monkeypatch):
    rule = RULES["more_devices_than_there_are"]
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    rule.prepare(monkeypatch)
    argv = ["bench", "--frameworks", "jax", "--modes", "cached", "--new-tokens", "2", "--repeats", "1"]
    code, out, err = run_cli(capsys, *argv, "--tensor-parallel", "1,2", "--json")
    assert code == 0, err
    rows = {row["tensor_parallel"]: row for row in json.loads(out)["rows"]}
    assert rows[1]["available"] and (rows[2]["available"], rows[2]["reason"]) == (False, rule.line)


# ---------------------------------------------------------------- one table of what each port runs


@pytest.mark.parametrize("framework", registry.PORTS)
def test_a_ports_load_time_check_and_the_rules_read_one_capability_table(framework):
    """What `check_rules` refuses of a port's precision and split, its own load-time check
    (shared.capabilities.refusal) refuses too, and nothing else: both read the one table."""
    from kvports.shared.capabilities import refusal
    from kvports.shared.config import DTYPES, QUANTS
    from kvports.shared.errors import UserError
    from kvports.validation import Setup, check_rules

    config = ModelConfig(d_model=16, n_heads=2, n_layers=1)
    for dtype in DTYPES:
        for quant in QUANTS:
            for split in (1, 2):
                if quant != "none" and (dtype == "float64" or split > 1):
                    continue  # refused for every port, by rules of their own
                setup = Setup((framework,), ("cached",), dtype, quant, "cpu", split)
                try:
                    check_rules(setup, models=[("the model", config)])
                    refused = False
                except UserError:
                    refused = True
                assert refused == (refusal(framework, dtype, quant, split) is not None), (dtype, quant, split)
