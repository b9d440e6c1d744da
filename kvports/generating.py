"""Generating, the second half of the run layer, the one path under the command line and the
Python API: typed inputs (`RunInputs`, `Draft`), checked once (`check_inputs`: the rules of what
the ports can run, `validation.check_rules`; each prompt as a `batching.request.Request`, held to
`check_request`), one `generate` for every mode, and its typed result (`Generation`).

    inputs = RunInputs("numpy", "cached", GenerationConfig(8))
    with open_model(inputs.weights) as file:                               # loading's
        config = header(file, inputs.dtype)
        prompts = check_inputs(inputs, config, [[160, 248, 104]]).prompts  # [B, P]: every check, once,
        tensors = read_tensors(file, inputs.dtype)                         # before a tensor is read
    loaded = load_model(inputs.framework, config, tensors, inputs.dtype, inputs.device)
    result = generate(loaded, prompts, inputs)                             # result.generated, .seconds, ...

`kvports generate`, `compare`, `bench`, `batch` (and its --bench) and `check`'s reference go
through these functions: their flags become these inputs, or `check_rules`' `Setup` where a
command runs several frameworks, formats or splits; the Python API (`kvports.load(...).generate(...)`)
builds them from its arguments and calls `check_and_prepare` on the model it loaded. What only an
imported port can tell (a GPU, the devices to split across) is `loading.port_for`'s, and
`usable_ports`' for several frameworks, still before any model loads. A draft model (speculative
mode) is read through the same opener as the model and loaded once, then kept on the `LoadedModel`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from kvports import registry
from kvports.batching.constraint import Grammars, ResponseFormat
from kvports.batching.request import Request, check_request
from kvports.devices import (
    DEVICES,
    prepare_tensor_parallel,
)
from kvports.limits import check_run
from kvports.loading import LoadedModel, Tensors, check_weights, header, open_model, read_tensors
from kvports.shared.checks import COMMAND_LINE, Names, check_choice, python_value
from kvports.shared.config import DTYPES, ModelConfig
from kvports.shared.contract import OnToken, Port, Timed
from kvports.shared.errors import UserError
from kvports.shared.generation import (
    PAD,
    GenerationConfig,
    finish_reasons,
    pad_prompts,
    repeat_samples,
    row_tokens,
    token_logprobs,
)
from kvports.threads import check_threads
from kvports.validation import (
    MODES,
    Setup,
    check_draft,
    check_draft_source,
    check_needed,
    check_ngram,
    check_rules,
    check_samples,
    check_seeds,
)

T = TypeVar("T")


@dataclass(frozen=True)
class Draft:
    """Speculative decoding's draft: a smaller model's weights file with the model's vocabulary,
    or "ngram" (prompt lookup); `tokens` proposals (K) per round; lookup matches `ngram` tokens."""

    source: str
    tokens: int = 4
    ngram: int = 2

    def __post_init__(self) -> None:
        # NumPy integers are taken as the values they hold: an index a port builds from them must be an int.
        object.__setattr__(self, "tokens", python_value(self.tokens))
        object.__setattr__(self, "ngram", python_value(self.ngram))


@dataclass(frozen=True)
class RunInputs:
    """One generation's inputs, typed: what argparse (or the API's arguments) turn into."""

    framework: str
    mode: str  # naive, cached or speculative
    generation: GenerationConfig
    weights: Path | None = None  # None: the seed's model, shipped with kvports
    dtype: str = "float32"
    device: str = "cpu"
    draft: Draft | None = None  # speculative mode's draft
    quant: str = "none"  # weight-only quantization: none, int8 (at load) or q4 (a GGUF's own 4-bit blocks)
    tensor_parallel: int = 1  # devices the model is split across (Megatron-style); 1: one device
    threads: int | None = None  # every framework's thread count (None: each one's default)
    logprobs: int = 0  # each step's chosen token's log-probability and the K likeliest alternatives
    # Each row's answer as JSON a schema describes (`--json-schema`): mode cached, run by the batching
    # engine, whose steps mask each row's logits to its grammar (batching.constraint); None: free text.
    response_format: ResponseFormat | None = None

    def setup(self, modes: Sequence[str] | None = None, frameworks: Sequence[str] | None = None) -> Setup:
        """What `check_rules` holds to the ports: these inputs, in `modes` (default: the inputs' own
        mode), by `frameworks` (default: the inputs' own framework)."""
        return Setup(
            tuple(frameworks) if frameworks is not None else (self.framework,),
            tuple(modes) if modes is not None else (self.mode,),
            self.dtype,
            self.quant,
            self.device,
            self.tensor_parallel,
            self.logprobs,
        )


@dataclass(frozen=True)
class Generation:
    """What one generation made, row by row (padding dropped), and how long it took."""

    tokens: list[list[int]]  # each row's prompt, then what it generated
    generated: list[list[int]]  # what each row generated (a stopped row ends with its stop token)
    finish_reason: list[str]  # "stop" (a stop token) or "length" (new_tokens reached)
    logits: np.ndarray | None  # [B, steps, V] when asked for (naive and cached)
    speculative: dict[str, Any] | None  # mode speculative: proposals, acceptances, target forwards per token
    seconds: float  # until the device was done (a draft's loading excluded)
    first_token_seconds: float | None = None  # until the first token reached the host (with on_token)
    text: list[str] | None = None  # each row decoded, prompt and generated, when a tokenizer is given
    padded: np.ndarray | None = None  # [B, P + N] as the port returned it, PAD where a row is short or stopped
    logprobs: list[list[dict[str, Any]]] | None = None  # per row, per generated token: see `step_logprobs`
    answer: list[str] | None = None  # what each row generated, decoded without special tokens (with a tokenizer)


def check_names(framework: object, dtype: object, device: object, names: Names) -> None:
    """The framework, dtype and device named: what the command line's choices do for its flags."""
    check_choice("framework", framework, registry.PORTS, names)
    check_choice("dtype", dtype, DTYPES, names)
    check_choice("device", device, DEVICES, names)


def check_load(setup: Setup, config: ModelConfig, names: Names = COMMAND_LINE) -> None:
    """A model to load with no run yet (the API's `load`): the rules against its config, and its bytes."""
    check_rules(setup, names, [("the model", config)])
    check_weights(config, setup.dtype)


@dataclass(frozen=True)
class Checked:
    """A run's inputs, checked: the prompts as one batch, and the frameworks asked for that cannot run it."""

    prompts: np.ndarray  # [B, P], left-padded with PAD (every row's last prompt token in the same column)
    unable: dict[str, str]  # framework -> the reason its rows give (compare); empty for one framework


def check_inputs(
    inputs: RunInputs,
    config: ModelConfig,
    prompts: Sequence[Sequence[object]],
    names: Names = COMMAND_LINE,
    modes: Sequence[str] | None = None,
    draft: ModelConfig | None = None,
    frameworks: Sequence[str] | None = None,
) -> Checked:
    """Every check of one run's inputs against its model, in one place, once: the rules of what
    the ports can run (`check_rules`, for `frameworks`, default the inputs' own), the prompts, the
    generation settings, the draft's settings (`draft`: its model's config, from its header; for
    `modes` with speculative, default: the inputs' own mode) and the bytes the run will allocate."""
    modes = [check_choice("mode", inputs.mode, MODES, names)] if modes is None else list(modes)
    frameworks = [inputs.framework] if frameworks is None else list(frameworks)
    speculative = "speculative" in modes
    models = [("the model", config)] + ([("the draft", draft)] if draft is not None and speculative else [])
    unable = check_rules(inputs.setup(modes, frameworks), names, models)
    generation = inputs.generation
    check_format_run(inputs, modes, names)
    rows = check_prompts(prompts, config, generation, names, inputs.response_format)  # each row as a request, checked
    check_seeds(generation, len(rows), names)
    draft_tokens = 0
    if speculative:
        source = None if inputs.draft is None else inputs.draft.source
        check_draft(inputs.mode, source, *draft_fields(inputs.draft), names)
        assert inputs.draft is not None
        draft_tokens = inputs.draft.tokens
        check_ngram(inputs.draft.ngram, max(map(len, rows)), generation.max_new_tokens, names)
        check_needed(max(map(len, rows)), generation.max_new_tokens, draft_tokens, models)
    prepare_tensor_parallel(inputs.tensor_parallel, inputs.device, frameworks)  # before anything starts JAX
    check_threads(inputs.threads, names)
    batch = pad_prompts(rows)[0]  # [B, P]
    B, P = batch.shape
    check_run(config, inputs.dtype, B, P, generation.max_new_tokens, modes, draft_tokens, draft)
    return Checked(batch, unable)


def check_format_run(inputs: RunInputs, modes: Sequence[str], names: Names = COMMAND_LINE) -> None:
    """A response format runs through the batching engine: in cached mode, without log-probabilities."""
    if inputs.response_format is None:
        return
    label = names.label("response_format")
    other = [mode for mode in modes if mode != "cached"]
    if other:
        raise UserError(f"{label} runs in {names.show('mode', 'cached')} only, not {other[0]}")
    if inputs.logprobs:
        raise UserError(f"{label} reports no {names.label('logprobs')}: leave one of them out")


def check_prompts(
    prompts: Sequence[Sequence[object]],
    config: ModelConfig,
    generation: GenerationConfig,
    names: Names = COMMAND_LINE,
    response_format: ResponseFormat | None = None,
) -> list[list[int]]:
    """Several prompts run with one generation's settings (the command line's and the API's rows), as
    rows of ids: each held to `check_request` as the request it is, named by its index."""
    if len(prompts) == 0:
        raise UserError("no prompt given")
    rows = [
        Request(str(index), tuple(prompt), generation, response_format=response_format)  # type: ignore[arg-type]  # checked next
        for index, prompt in enumerate(prompts)
    ]
    return [
        [int(token) for token in check_request(row, config, names, row=index).prompt] for index, row in enumerate(rows)
    ]


def with_samples(
    inputs: RunInputs, prompts: Sequence[Sequence[Any]], num_samples: object, names: Names = COMMAND_LINE
) -> tuple[RunInputs, list[list[Any]]]:
    """`num_samples` copies of each prompt, seeded seed, seed + 1, ... (`generation.repeat_samples`):
    the inputs and prompt rows of a run asked for several samples of each prompt."""
    if num_samples == 1 and not isinstance(num_samples, bool) or not prompts:
        return inputs, [list(prompt) for prompt in prompts]
    count = check_samples(num_samples, inputs.generation, len(prompts), names)
    rows, generation = repeat_samples(prompts, inputs.generation, count)
    return dataclasses.replace(inputs, generation=generation), rows


def draft_fields(draft: Draft | None) -> tuple[object, object]:
    return (4, 2) if draft is None else (draft.tokens, draft.ngram)


def draft_file(inputs: RunInputs, names: Names = COMMAND_LINE, modes: Sequence[str] | None = None) -> str | None:
    """The draft model's weights file a run needs read (speculative with a file), or None."""
    speculative = "speculative" in (modes if modes is not None else [inputs.mode])
    if not speculative or inputs.draft is None or inputs.draft.source == "ngram":
        return None
    check_draft_source(inputs.draft.source, names)
    return inputs.draft.source


def check_and_prepare(
    loaded: LoadedModel, inputs: RunInputs, prompts: Sequence[Sequence[object]], names: Names = COMMAND_LINE
) -> np.ndarray:
    """`check_inputs` for a model already loaded (the Python API): a draft file is read, checked
    and loaded on first use, then kept on `loaded` for the calls after."""
    source = draft_file(inputs, names)
    if source is None or source in loaded.drafts:
        draft = None if source is None else loaded.drafts[source][0]
        return check_inputs(inputs, loaded.config, prompts, names, draft=draft).prompts
    with open_model(Path(source)) as file:  # through the load cache, as the model
        draft = header(file, inputs.dtype)
        batch = check_inputs(inputs, loaded.config, prompts, names, draft=draft).prompts
        loaded.add_draft(source, draft, read_tensors(file, inputs.dtype))
    return batch


SHORTEST_SHAPE = 64  # prompt columns: the smallest compiled prefill a session's calls share


def session_shape(loaded: LoadedModel, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
    """Checked prompts [B, P] for one call of a session on a loaded model whose calls differ in length
    (a chat's turns): for a port that compiles each shape (`registry.COMPILES`), left-padded with PAD
    to the next power of two (at least SHORTEST_SHAPE) that still fits the context with `new_tokens`,
    so the turns share a few compiled programs instead of compiling two for each; as they are for
    the others. The padding is a ragged batch's: the ports' masks and positions skip it."""
    B, P = prompts.shape
    if loaded.framework not in registry.COMPILES:
        return prompts
    width = max(SHORTEST_SHAPE, 1 << (P - 1).bit_length())
    width = max(P, min(width, loaded.config.max_seq_len - new_tokens))
    return np.concatenate([np.full((B, width - P), PAD, dtype=prompts.dtype), prompts], axis=1)  # [B, width]


def read_draft(
    inputs: RunInputs, config: ModelConfig, prompts: np.ndarray, setups: Sequence[Setup]
) -> tuple[ModelConfig, Tensors] | None:
    """The bench's draft: config and tensors, checked against the model and the run (`check_rules`
    for each of the bench's `setups`); None for prompt lookup."""
    source = draft_file(inputs)
    if source is None:
        return None
    assert inputs.draft is not None
    with open_model(Path(source)) as file:  # through the load cache, as the model
        for setup in setups:
            check_rules(setup, COMMAND_LINE, [("the model", config), ("the draft", file.config)])
        B, P = prompts.shape
        N, K = inputs.generation.max_new_tokens, inputs.draft.tokens
        check_needed(P, N, K, [("the model", config), ("the draft", file.config)])
        check_run(config, inputs.dtype, B, P, N, ["speculative"], K, file.config)
        return file.config, file.read(inputs.dtype)


def draft_model(loaded: LoadedModel, inputs: RunInputs) -> Any:
    """The run's draft model, loaded onto `loaded` beforehand; None for prompt lookup."""
    assert inputs.draft is not None
    return None if inputs.draft.source == "ngram" else loaded.drafts[inputs.draft.source][1]


def timed(call: Callable[[], T], module: Timed, model: Any) -> tuple[T, float]:
    """(what call returns, seconds until the device is done)."""
    start = time.perf_counter()
    result = call()
    module.synchronize(model)
    return result, time.perf_counter() - start


def run_port(
    port: Port,
    model: Any,
    draft: Any,
    prompts: np.ndarray,
    inputs: RunInputs,
    return_logits: bool = False,
    on_token: OnToken | None = None,
) -> tuple[np.ndarray, np.ndarray | None, dict[str, int] | None]:
    """The one switch between the port's generators: (tokens [B, P + N], logits or None, speculative counts or None)."""
    if inputs.mode == "speculative":
        assert inputs.draft is not None
        tokens, counts = port.generate_speculative(
            model, draft, prompts, inputs.generation, inputs.draft.tokens, inputs.draft.ngram, on_token=on_token
        )
        return tokens, None, counts
    tokens, logits = port.generate(model, prompts, inputs.generation, inputs.mode, return_logits, on_token=on_token)
    return tokens, logits, None


def generate(
    loaded: LoadedModel,
    prompts: np.ndarray,
    inputs: RunInputs,
    return_logits: bool = False,
    on_token: OnToken | None = None,
    tokenizer: Any = None,
) -> Generation:
    """One generation, any mode, of prompts `check_inputs` returned [B, P] (a speculative run's
    draft prepared first). With on_token, the time to the first token is measured too."""
    if inputs.response_format is not None:
        return generate_constrained(loaded, prompts, inputs, on_token, tokenizer)
    draft = draft_model(loaded, inputs) if inputs.mode == "speculative" else None
    first: list[float] = []

    def heard(token: np.ndarray) -> None:
        if not first:
            first.append(time.perf_counter())
        assert on_token is not None
        on_token(token)

    start = time.perf_counter()
    tokens, logits, counts = run_port(
        loaded.port,
        loaded.model,
        draft,
        prompts,
        inputs,
        return_logits or inputs.logprobs > 0,
        None if on_token is None else heard,
    )
    loaded.port.synchronize(loaded.model)
    seconds = time.perf_counter() - start
    result = result_of(
        tokens,
        prompts,
        inputs,
        logits if return_logits else None,
        counts,
        seconds,
        first[0] - start if first else None,
        tokenizer,
    )
    if inputs.logprobs and logits is not None:
        steps = step_logprobs(logits, tokens, prompts.shape[1], inputs.logprobs)
        result = replace(result, logprobs=steps if tokenizer is None else with_token_text(steps, tokenizer))
    return result


def generate_constrained(
    loaded: LoadedModel, prompts: np.ndarray, inputs: RunInputs, on_token: OnToken | None, tokenizer: Any
) -> Generation:
    """A generation whose rows follow a response format: each prompt row a request of the batching
    engine (the server's path, so the grammar's mask is applied in one place for every front door),
    seeded as `generate` seeds its rows. A row ends when its grammar is complete ("stop"). on_token
    hears each step's tokens [B], PAD for a row that made none in that step."""
    from kvports.batching.engine import BatchSettings, Engine

    if tokenizer is None:
        raise UserError(f"{COMMAND_LINE.label('response_format')} needs the model's tokenizer (a GGUF file's own)")
    B, P = prompts.shape
    generation = inputs.generation
    N = generation.max_new_tokens
    config = loaded.config
    grammars = Grammars(tokenizer, config.vocab_size, tuple(config.eos_token_ids))
    settings = BatchSettings(max_batch=B, max_length=P + N)
    engine = Engine(loaded.port, loaded.model, config, settings, dtype=inputs.dtype, grammars=grammars)
    seeds = generation.row_seeds(B)
    sequences = [
        engine.add(
            Request(
                str(row),
                tuple(prompt),
                replace(generation, seed=seeds[row], seeds=()),
                response_format=inputs.response_format,
            )
        )
        for row, prompt in enumerate(row_tokens(prompts))
    ]
    start = time.perf_counter()
    first_token: float | None = None
    while not engine.idle:
        made = [len(sequence.generated) for sequence in sequences]
        engine.step()
        if first_token is None:
            first_token = time.perf_counter()
        if on_token is not None:
            grown = [len(sequence.generated) > before for sequence, before in zip(sequences, made, strict=True)]
            on_token(np.asarray([s.generated[-1] if g else PAD for s, g in zip(sequences, grown, strict=True)]))
    seconds = time.perf_counter() - start
    tokens = np.full((B, P + N), PAD, dtype=np.int64)  # [B, P + N]
    tokens[:, :P] = prompts
    for row, sequence in enumerate(sequences):
        tokens[row, P : P + len(sequence.generated)] = sequence.generated
    result = result_of(
        tokens, prompts, inputs, None, None, seconds, None if first_token is None else first_token - start, tokenizer
    )
    return replace(result, finish_reason=[str(sequence.finish_reason) for sequence in sequences])


def with_token_text(rows: list[list[dict[str, Any]]], tokenizer: Any) -> list[list[dict[str, Any]]]:
    """Each logprobs entry and its alternatives with the token's own text ("text") beside its id."""
    from kvports.formats.hf.text import decode

    def spelled(entry: dict[str, Any]) -> dict[str, Any]:
        return {"token": entry["token"], "text": decode(tokenizer, [entry["token"]]), "logprob": entry["logprob"]}

    return [
        [{**spelled(step), "top": [spelled(alternative) for alternative in step["top"]]} for step in steps]
        for steps in rows
    ]


def result_of(
    tokens: np.ndarray,
    prompts: np.ndarray,
    inputs: RunInputs,
    logits: np.ndarray | None,
    counts: dict[str, int] | None,
    seconds: float,
    first_token_seconds: float | None = None,
    tokenizer: Any = None,
) -> Generation:
    P = prompts.shape[1]
    rows, prompt_rows = row_tokens(tokens), row_tokens(prompts)
    text = answer = None
    generated = [row[len(prompt) :] for row, prompt in zip(rows, prompt_rows, strict=True)]
    if tokenizer is not None:
        from kvports.formats.hf.text import decode, decode_answer

        text = [decode(tokenizer, row) for row in rows]  # prompt and generated, as `tokens` holds them
        answer = [decode_answer(tokenizer, row) for row in generated]
    return Generation(
        tokens=rows,
        generated=generated,
        finish_reason=finish_reasons(tokens, P, inputs.generation.stop_ids),
        logits=logits,
        speculative=None if counts is None else speculative_summary(counts, inputs, tokens, P),
        seconds=seconds,
        first_token_seconds=first_token_seconds,
        text=text,
        padded=tokens,
        answer=answer,
    )


def speculative_summary(counts: dict[str, int], inputs: RunInputs, tokens: np.ndarray, P: int) -> dict[str, Any]:
    """The counts a user wants: proposals, acceptances, their rate, and target forwards per
    generated token (of the longest row: every row moves with the batch)."""
    assert inputs.draft is not None
    generated = int((tokens[:, P:] != PAD).sum(axis=1).max())
    return {
        "draft": inputs.draft.source,
        "draft_tokens": inputs.draft.tokens,
        **counts,
        "acceptance_rate": counts["accepted"] / counts["proposed"] if counts["proposed"] else 0.0,
        "target_forwards_per_token": counts["target_forwards"] / max(generated, 1),
    }


def step_logprobs(logits: np.ndarray, tokens: np.ndarray, prompt_len: int, top: int) -> list[list[dict[str, Any]]]:
    """Each row's generated tokens with their log-probabilities under the model and the `top`
    likeliest tokens of that step (`shared.generation.token_logprobs`, the one rule the engine's
    rows are reported by too): [{"token", "logprob", "top": [{"token", "logprob"}]}] per step, up
    to the row's stop. logits: [B, steps, V]; tokens: [B, P + N]."""
    rows: list[list[dict[str, Any]]] = []
    for row_logits, row in zip(logits, np.asarray(tokens)[:, prompt_len:], strict=True):
        generated = row[: len(row_logits)]  # [steps]
        stopped = np.flatnonzero(generated == PAD)
        steps = len(generated) if len(stopped) == 0 else int(stopped[0])
        chosen, top_ids, top_logprobs = token_logprobs(row_logits[:steps], generated[:steps], top)  # as rows [steps]
        rows.append(
            [
                {
                    "token": int(token),
                    "logprob": float(chosen[step]),
                    "top": [
                        {"token": int(i), "logprob": float(p)}
                        for i, p in zip(top_ids[step], top_logprobs[step], strict=True)
                    ],
                }
                for step, (token, ids, values) in enumerate(zip(generated[:steps], top_ids, top_logprobs, strict=True))
            ]
        )
    return rows
