"""Accepted means it runs: every port x dtype x quant x mode that the rules accept (`check_rules`)
runs and answers on this CPU, and on the route a CPU without AVX-512, AMX or AVX-NE-CONVERT takes
(KVPORTS_CPU=avx2, shared/cpu.py), through every load path of a GGUF file: the first load, which
builds the load cache, the second, which maps it, and the cache off. Its tokens agree with the same
port's float32 within the format's distance; every combination the rules refuse is one line. The
same table through `kvports batch` and one `kvports serve` request per port and format.

A tiny random Llama with Q4_1 matrices stands in for a real model here (q4 keeps its blocks, the
other formats read them dequantized); tests/test_smollm2.py holds the real model to the same table."""

from __future__ import annotations

import itertools
import json
import urllib.request

import numpy as np
import pytest

import kvports
from kvports.registry import PORTS
from kvports.shared.checks import API, COMMAND_LINE, Names
from kvports.shared.config import DTYPES, QUANTS
from kvports.shared.errors import UserError
from kvports.validation import Setup, check_rules
from tests.helpers.agreement import assert_within_format_distance
from tests.helpers.commands import assert_one_error_line, run_cli
from tests.helpers.gguf_files import write_gguf
from tests.helpers.ports import port_or_skip
from tests.helpers.servers import start_server

MODES = ("naive", "cached", "speculative")
PROMPT = [5, 17, 100, 33, 250, 7]
NEW_TOKENS = 6
FORMATS = [(dtype, quant) for dtype in DTYPES for quant in QUANTS]
# The torch port is the one whose routes depend on the CPU (torch_impl/fast): it runs the table twice.
ROUTES = {"torch": ("native", "avx2")}


def refusal(
    framework: str, dtype: str, quant: str, modes: tuple[str, ...] = MODES, names: Names = COMMAND_LINE
) -> str | None:
    """The rules' one line for this combination (worded for `names`), or None where they accept it."""
    try:
        check_rules(Setup((framework,), modes, dtype, quant), names)
    except UserError as exc:
        return str(exc)
    return None


ACCEPTED = [
    pytest.param(framework, dtype, quant, route, id=f"{framework}-{dtype}-{quant}-{route}")
    for framework, (dtype, quant) in itertools.product(PORTS, FORMATS)
    for route in ROUTES.get(framework, ("native",))
    if refusal(framework, dtype, quant) is None
]
REFUSED = [
    pytest.param(framework, dtype, quant, id=f"{framework}-{dtype}-{quant}")
    for framework, (dtype, quant) in itertools.product(PORTS, FORMATS)
    if refusal(framework, dtype, quant) is not None
]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("accepted") / "tiny.gguf", "Q4_1")


@pytest.fixture(scope="module")
def float32_runs(tiny_gguf):
    """Each port's float32 tokens and logits in each mode: what every other format is held to."""
    runs: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}

    def get(framework: str, mode: str) -> tuple[np.ndarray, np.ndarray]:
        if (framework, mode) not in runs:
            model = kvports.load(framework, tiny_gguf)
            runs[framework, mode] = answer(model, mode)
        return runs[framework, mode]

    return get


def answer(model: kvports.Model, mode: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(tokens [1, P + N], step logits [1, N, V] or None for speculative) of one greedy generation."""
    options = {"draft": "ngram"} if mode == "speculative" else {"return_logits": True}
    result = model.generate(PROMPT, new_tokens=NEW_TOKENS, stop_ids=[], mode=mode, **options)
    assert [len(row) for row in result.generated] == [NEW_TOKENS], result.generated
    return np.array(result.tokens), result.logits


@pytest.mark.parametrize(("framework", "dtype", "quant", "route"), ACCEPTED)
def test_every_accepted_format_answers_through_every_load_path(
    framework, dtype, quant, route, tiny_gguf, float32_runs, tmp_path, monkeypatch
):
    port_or_skip(framework)
    monkeypatch.setenv("KVPORTS_CPU", route)
    monkeypatch.setenv("KVPORTS_HOME", str(tmp_path))  # an empty load cache: the first load builds it
    first = kvports.load(framework, tiny_gguf, dtype, quant=quant)
    assert any(tmp_path.rglob("*")), "the first load built no load cache"
    mapped = kvports.load(framework, tiny_gguf, dtype, quant=quant)
    monkeypatch.setenv("KVPORTS_LOAD_CACHE", "0")
    uncached = kvports.load(framework, tiny_gguf, dtype, quant=quant)
    tokens32, logits32 = float32_runs(framework, "cached")
    for path, model in (("first load", first), ("mapped", mapped), ("cache off", uncached)):
        tokens, logits = answer(model, "cached")
        assert_within_format_distance(tokens32, logits32, tokens, logits, len(PROMPT), dtype, quant, path)
    tokens, logits = answer(mapped, "naive")
    assert_within_format_distance(*float32_runs(framework, "naive"), tokens, logits, len(PROMPT), dtype, quant, "naive")
    tokens, _ = answer(mapped, "speculative")
    cached_tokens, cached_logits = answer(mapped, "cached")  # verification at this format: its own cached tokens
    assert_within_format_distance(cached_tokens, cached_logits, tokens, None, len(PROMPT), dtype, quant, "speculative")


@pytest.mark.parametrize(("framework", "dtype", "quant"), REFUSED)
def test_every_refused_format_is_one_line_before_anything_loads(
    framework, dtype, quant, tiny_gguf, capsys, no_port_may_load
):
    argv = ["--framework", framework, "--weights", tiny_gguf, "--dtype", dtype, "--quant", quant, "--prompt", "5,17"]
    line = assert_one_error_line(*run_cli(capsys, "generate", "--mode", "cached", *argv))
    assert line == f"error: {refusal(framework, dtype, quant, ('cached',))}\n"
    with pytest.raises(UserError) as raised:
        kvports.load(framework, tiny_gguf, dtype, quant=quant)
    assert str(raised.value) == refusal(framework, dtype, quant, (), API)


# 40 tokens: past the 16 queries from which NumPy's prompt attention runs by blocks at any --threads
LONG_PROMPTS = {
    "equal": [[(7 * i) % 250 + 3 for i in range(40)], [(11 * i) % 250 + 3 for i in range(40)]],  # one mask row
    "ragged": [[(13 * i) % 250 + 3 for i in range(40)], [(17 * i) % 250 + 3 for i in range(20)]],
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("framework", PORTS)
def test_every_thread_count_answers_each_mode_and_batch_with_the_defaults_tokens(framework, threads, tiny_gguf):
    """`threads=N` sets every framework's count and swaps kernels in (NumPy's prompt attention by
    blocks, at any N): at 1 and 2 threads every mode answers two equal prompts (one mask row they
    share) and a ragged pair with the tokens the frameworks' own counts give. (The products too small
    to split here: tests/test_split_products.py.)"""
    port_or_skip(framework)

    def tokens(model: kvports.Model) -> dict[tuple[str, str], list[list[int]]]:
        return {
            (mode, shape): model.generate(
                prompts,
                new_tokens=NEW_TOKENS,
                stop_ids=[],
                mode=mode,
                **({"draft": "ngram"} if mode == "speculative" else {}),
            ).tokens
            for mode in MODES
            for shape, prompts in LONG_PROMPTS.items()
        }

    expected = tokens(kvports.load(framework, tiny_gguf))
    assert tokens(kvports.load(framework, tiny_gguf, threads=threads)) == expected


def batch_formats() -> list:
    return [
        pytest.param(framework, dtype, quant, id=f"{framework}-{dtype}-{quant}")
        for framework, (dtype, quant) in itertools.product(PORTS, FORMATS)
        if refusal(framework, dtype, quant, ("paged",)) is None
    ]


@pytest.mark.parametrize(("framework", "dtype", "quant"), batch_formats())
def test_every_accepted_format_answers_in_kvports_batch(framework, dtype, quant, tiny_gguf, tmp_path, capsys):
    port_or_skip(framework)
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"prompt": PROMPT[: 3 + n]}) + "\n" for n in range(3)))
    argv = ["--weights", tiny_gguf, "--dtype", dtype, "--quant", quant, "--requests", requests, "--new-tokens", 4]
    code, out, err = run_cli(capsys, "batch", "--framework", framework, *argv)
    assert code == 0, err
    answers = [line for line in map(json.loads, out.splitlines()) if "id" in line]  # the last line: the summary
    assert len(answers) == 3 and all(len(answer["tokens"]) == 4 for answer in answers), answers


@pytest.mark.slow
@pytest.mark.parametrize(("framework", "dtype", "quant"), batch_formats())
def test_every_accepted_format_answers_a_kvports_serve_request(framework, dtype, quant, tiny_gguf):
    port_or_skip(framework)
    # --no-precompile: one request needs none of the 49 programs a JAX server compiles first (8 s each server here).
    argv = ("--framework", framework, "--weights", tiny_gguf, "--dtype", dtype, "--quant", quant, "--no-precompile")
    server = start_server(*argv)
    try:
        body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}).encode()
        request = urllib.request.Request(
            f"{server.url}/v1/completions", body, {"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.load(response)
    finally:
        server.stop()
    assert answer["choices"][0]["finish_reason"] == "length", answer
    assert answer["usage"]["completion_tokens"] == 4, answer
