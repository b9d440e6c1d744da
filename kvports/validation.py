"""The checks of one run's inputs, before any framework code runs: its prompts, the rules of
what the ports can run (`check_rules`: the precision, modes, device and tensor parallelism a port
offers, and how they combine, with a speculative draft's vocabulary), speculative decoding's
settings, the flags that go together, and the bench's own counts. The run layer (run.py) calls
them for every command; every port gets the same message, naming its value and the limit.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvports import registry
from kvports.devices import check_cpu_only
from kvports.limits import check_run
from kvports.shared import cpu
from kvports.shared.checks import (
    API,
    COMMAND_LINE,
    MAX_SEED,
    Names,
    check_choice,
    check_count,
    check_range,
    kv_layout,
)
from kvports.shared.config import QUANTS, ModelConfig
from kvports.shared.errors import UserError, echo, echo_path
from kvports.shared.files import check_writable_folder, os_errors_as_user_errors
from kvports.shared.generation import GenerationConfig

__all__ = ["API", "COMMAND_LINE", "Names"]  # re-exported: the commands name their values through them


SEED_PROMPT = (160, 248, 104, 209, 394)


MAX_ID_DIGITS = 30  # far past any vocabulary (config.MAX_SIZE has 10)


MAX_DRAFT_TOKENS = 16  # a verified chunk is K + 1 wide; past this the draft is the bottleneck anyway


# Prompt lookup matches a few tokens; JAX compares n shifted copies of the token buffer, unrolled
# in its compiled loop, so a huge n would compile without end (and one past the buffer fails).
MAX_NGRAM = 64


MODES = ("naive", "cached", "speculative")


MAX_TENSOR_PARALLEL = 64  # devices one model is split across: far past any one machine's GPUs


MAX_SAMPLES = 1024  # copies of one prompt: the batch they make is bounded again, in bytes, by check_run


MAX_IDS = 1 << 20  # ids in one prompt or stop list: past any context, and ~40 MB as a Python list


def bounded_ids(name: str, value: object, limit: int = MAX_IDS) -> list[Any]:
    """The items of a list of ids the API was given (a prompt, a row of one, stop_ids), read no further
    than `limit` + 1 of them: a range of 10**9 or a generator is refused by its size before anything
    is made of it; bytes are refused rather than read as the ids of their characters' codes."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise UserError(f"{name}={echo(value)} is bytes: give token ids, or '1,2,3' as a str")
    if isinstance(value, np.ndarray):
        if value.size > limit:
            raise UserError(f"{name} holds {value.size} ids, above {limit}")
        return list(value.tolist())
    size = len(value) if hasattr(value, "__len__") else None
    if size is not None and size > limit:
        raise UserError(f"{name} holds {size} ids, above {limit}")
    items = list(itertools.islice(value, limit + 1))  # type: ignore[call-overload]
    if len(items) > limit:
        raise UserError(f"{name} holds more than {limit} ids")
    return items


def bounded_prompts(prompts: object) -> object:
    """The API's prompts with every list bounded (bounded_ids): a str as given, else a list of ids,
    or of rows (each a str, or a list of ids)."""
    if isinstance(prompts, str):
        return prompts
    return [bounded_ids("prompts", row) if isinstance(row, ROWS) else row for row in bounded_ids("prompts", prompts)]


ROWS = (bytes, bytearray, memoryview, np.ndarray, list, tuple, range)  # what bounded_prompts reads as a row


def parse_prompt(text: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3]; anything but comma-separated integers in ASCII digits is refused
    (Python's int() would also read `1_0`, Arabic-Indic and fullwidth digits)."""
    parts = [part.strip() for part in text.split(",")]
    if parts == [""]:
        raise UserError("empty prompt: give at least one token id")
    ids = []
    for part in parts:
        if part == "":
            raise UserError(f"prompt {echo(text)} has an empty token id (stray comma?)")
        if re.fullmatch(r"-?[0-9]+", part, flags=re.ASCII) is None:
            raise UserError(f"prompt token {echo(part)} is not an integer")
        if len(part.lstrip("-")) > MAX_ID_DIGITS:  # thousands of digits would only be slow to read and to echo
            raise UserError(f"prompt token {echo(part)} has {len(part.lstrip('-'))} digits: no token id is that long")
        ids.append(int(part))
    return ids


# The reduced precisions each port offers: where its framework has a fast product for them on the CPU
# (NumPy has no bfloat16 and no integer matrix product that would beat its own float32 one).
PRECISIONS = {"torch": ("bfloat16", "int8", "q4"), "jax": ("bfloat16", "int8", "q4"), "numpy": ()}


def check_q4_file(quant: str, has_q4: bool, source: str, names: Names = COMMAND_LINE) -> None:
    """--quant q4 keeps a file's own 4-bit blocks: a file without any is refused (before it is read)."""
    if quant == "q4" and not has_q4:
        raise UserError(
            f"{shown(names, 'quant', quant)} needs a GGUF file with Q4_0 or Q4_1 matrices; {echo_path(source)} has none"
        )


def missing_precision(framework: str, dtype: str, quant: str) -> str | None:
    """The dtype or quant asked for that `framework` does not offer, or None."""
    for value in (dtype, quant):
        if any(value in precisions for precisions in PRECISIONS.values()) and value not in PRECISIONS[framework]:
            return value
    return None


def check_seeds(generation: GenerationConfig, rows: int, names: Names = COMMAND_LINE) -> None:
    """Per-row seeds: one for each row of the batch, or none (every row then uses the one seed)."""
    if generation.seeds and len(generation.seeds) != rows:
        raise UserError(
            f"{names.show('seeds', echo(list(generation.seeds)))} gives {len(generation.seeds)} seeds for "
            f"{rows} prompts: give one seed, or one per prompt"
        )


def check_samples(num_samples: object, generation: GenerationConfig, rows: int, names: Names = COMMAND_LINE) -> int:
    """--num-samples N: each prompt N times, seeded seed, seed + 1, ..., seed + N - 1 (each within a
    Philox key word), at most MAX_SAMPLES copies of each, and one seed per prompt if seeds are given."""
    count = check_range("num_samples", num_samples, 1, names, MAX_SAMPLES)
    check_count(f"prompts x {names.label('num_samples')}", rows * count)
    check_seeds(generation, rows, names)
    top = max(generation.row_seeds(rows)) + count - 1
    if top > MAX_SEED:
        raise UserError(f"{names.show('num_samples', str(count))} takes the seed to {top}, above {MAX_SEED}")
    return count


def check_draft(mode: str, draft: str | None, draft_tokens: object, ngram: object, names: Names) -> None:
    """A speculative run's draft settings (the draft file itself is read later, checked against the model)."""
    if draft is None:
        if names.api:
            raise UserError(f"mode={mode!r} needs draft= a smaller model's weights file, or draft='ngram'")
        raise UserError("--mode speculative needs --draft FILE (a smaller model) or --draft ngram")
    check_draft_source(draft, names)
    check_range("draft_tokens", draft_tokens, 1, names, MAX_DRAFT_TOKENS)
    check_range("ngram", ngram, 1, names, MAX_NGRAM)


def check_tensor_parallel(
    tensor_parallel: object, framework: str, models: Sequence[tuple[str, ModelConfig]] = (), names: Names = COMMAND_LINE
) -> int:
    """N devices for one model: `check_rules` with nothing else asked. N."""
    check_rules(Setup((framework,), tensor_parallel=tensor_parallel), names, models)
    assert isinstance(tensor_parallel, (int, np.integer))  # check_rules: a whole number in [1, 64]
    return int(tensor_parallel)


def check_draft_source(draft: str, names: Names = COMMAND_LINE) -> None:
    """Before a draft file is opened: '' as a path would be the current folder."""
    if draft.strip() == "":
        raise UserError(f"{names.show('draft', repr(draft))} is empty: give a smaller model's weights file or 'ngram'")


def check_ngram(ngram: int, prompt_len: int, new_tokens: int, names: Names = COMMAND_LINE) -> None:
    """Prompt lookup's n-gram within the tokens a run holds (the prompt and the new tokens): a
    longer one could never match, and JAX's compiled lookup slices the buffer by it."""
    held = prompt_len + new_tokens
    if ngram > held:
        raise UserError(
            f"{names.show('ngram', str(ngram))} is above prompt length {prompt_len} + new tokens {new_tokens} = "
            f"{held}, the tokens the run holds"
        )


def check_needed(prompt_len: int, new_tokens: int, draft_tokens: int, models: list[tuple[str, ModelConfig]]) -> None:
    needed = prompt_len + new_tokens + draft_tokens  # a round writes up to K past what it keeps
    for name, model_config in models:
        if needed > model_config.max_seq_len:
            raise UserError(
                f"prompt length {prompt_len} + new tokens {new_tokens} + draft tokens "
                f"{draft_tokens} = {needed} exceeds {name}'s max_seq_len {model_config.max_seq_len}"
            )


def check_draft_model(config: ModelConfig, draft: ModelConfig) -> None:
    """A draft proposes the model's own tokens: the same vocabulary."""
    if draft.vocab_size != config.vocab_size:
        raise UserError(
            f"the draft's vocab_size {draft.vocab_size} differs from the model's "
            f"{config.vocab_size}: a draft must propose the target's tokens"
        )


def check_stop_flags(stop_ids: Sequence[int] | None, no_stop: bool) -> None:
    if no_stop and stop_ids:
        raise UserError("give --stop-id or --no-stop, not both")


def check_text_flags(text: Sequence[str] | None, tokenizer: object, prompt: Sequence[str] | None, chat: bool) -> None:
    """tokenizer: --tokenizer DIR, or True for a GGUF weights file's own; chat: --chat or --chat-file given."""
    if (text is not None or chat) and not tokenizer:
        raise UserError(
            "--text and --chat need --tokenizer DIR (a folder holding tokenizer.json) or a GGUF file with its "
            "tokenizer (--model NAME or --weights FILE.gguf)"
        )
    if chat and (prompt or text is not None):
        raise UserError("give --chat/--chat-file, --text or --prompt, not two of them")
    if text is not None and prompt:
        raise UserError("give --prompt (token ids) or --text, not both")


def check_at_least(name: str, value: int, limit: int, why: str = "") -> None:
    if value < limit:
        raise UserError(f"{name} {value} is below {limit}{why}")


def check_bench_counts(batch: int, prompt_len: int, new_tokens: int, repeats: int, warmup: int) -> None:
    """The counts the bench needs, before anything loads. (Integers, not argparse types: the
    messages name the rule each limit comes from.)"""
    check_at_least("--batch", batch, 1)
    check_at_least("--prompt-len", prompt_len, 1)
    check_at_least("new tokens", new_tokens, 2, ": decode timing needs a step after the first token")
    check_at_least("--repeats", repeats, 1)
    check_at_least("--warmup", warmup, 1, ": the first call (and JAX's compile) must stay out of the figures")
    flags = {"--batch": batch, "--prompt-len": prompt_len, "--new-tokens": new_tokens, "--repeats": repeats}
    for name, value in {**flags, "--warmup": warmup}.items():
        check_count(name, value)


def check_bench_run(
    config: ModelConfig, modes: Sequence[str], longest: int, dtype: str, batch: int, prompt_len: int, new_tokens: int
) -> None:
    """The bench's sizes against the model, and the bytes of its longest generation (`longest`
    new tokens: --new-tokens, or a --sweep value) against the limit: before the prompts are
    built or any tensor is read."""
    total = prompt_len + new_tokens
    if total > config.max_seq_len:
        raise UserError(
            f"prompt length {prompt_len} + new tokens {new_tokens} = {total} exceeds max_seq_len {config.max_seq_len}"
        )
    check_run(config, dtype, batch, prompt_len, longest, modes)


def check_bench_outputs(plot: Path | None, csv: Path | None, as_json: bool) -> None:
    """--plot and --csv, checked before anything runs: a long run must not fail at its end."""
    if plot is not None:
        if importlib.util.find_spec("matplotlib") is None:
            raise UserError("--plot needs matplotlib: pip install 'kvports[plot]'")
        with os_errors_as_user_errors(plot):
            if plot.exists() and not plot.is_dir():
                raise UserError(f"--plot {echo_path(plot)} is a file, not a folder")
            check_writable_folder(plot.parent, plot.name)
    if csv is not None and str(csv) == "-" and as_json:
        raise UserError("--csv - and --json both print to stdout: give --csv a FILE")
    if csv is not None and str(csv) != "-":
        with os_errors_as_user_errors(csv):
            if csv.is_dir():
                raise UserError(f"--csv {echo_path(csv)} is a folder; give the file to write")
            check_writable_folder(csv.parent, csv.name)


MAX_LOGPROBS = 20  # alternatives per step, as OpenAI's API bounds its own


def check_logprobs(logprobs: object, modes: Sequence[str], vocab_size: int, names: Names = COMMAND_LINE) -> int:
    """0 (none), or the alternatives per step, at most 20 and the vocabulary; naive and cached
    only: speculative decoding verifies a round of proposals at once and keeps no step's logits."""
    count = check_range("logprobs", logprobs, 0, names, min(MAX_LOGPROBS, vocab_size))
    if count and "speculative" in modes:
        how = "mode='naive' or 'cached'" if names.api else "--mode naive or cached"
        raise UserError(
            f"{names.show('logprobs', str(count))} needs {how}: speculative decoding verifies proposals in "
            "rounds and keeps no step's logits"
        )
    return count


# ---------------------------------------------------------------- the rules of what the ports run


def shown(names: Names, field: str, value: object) -> str:
    """A value as a message names it: `--quant int8` on the command line, `quant='int8'` in the API."""
    return names.show(field, repr(value) if names.api and isinstance(value, str) else str(value))


@dataclass(frozen=True)
class Setup:
    """What a run asks the ports for, all `check_rules` needs besides the model's config: the
    frameworks that would run it (one for generate, batch and the API; compare and the benches
    name several), its modes (naive, cached, speculative, and batch's paged; none yet at the
    API's load), the precision, where it runs and across how many devices, and --logprobs."""

    frameworks: tuple[str, ...]
    modes: tuple[str, ...] = ()
    dtype: str = "float32"
    quant: object = "none"
    device: str = "cpu"
    tensor_parallel: object = 1
    logprobs: object = 0


class Refusal(UserError):
    """One framework that cannot run what a run asks: its message, and the shorter `reason` a row
    gives in a command that runs several frameworks (compare: `no bfloat16`)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def check_rules(
    setup: Setup, names: Names = COMMAND_LINE, models: Sequence[tuple[str, ModelConfig]] = ()
) -> dict[str, str]:
    """Every rule of what the ports can run, in one place, checked before any port is imported:
    quant over float64 activations; a dtype or quant a port lacks (PRECISIONS), or has on the CPU only
    (CPU_QUANTS); the split's range;
    quant on one device only; a port that splits nothing, or not in this mode (SPLIT_MODES); whole
    heads and FFN slices per device for each of `models` (the model, and a speculative draft);
    a mode a port lacks (registry.MODES); a GPU asked of CPU-only ports; a draft's vocabulary
    (`models`' second against the first); --logprobs with the model's vocabulary and the modes.
    A port's GPU and its device count are known once it is imported: `run.port_for`.

    One framework runs all of it, or the run is refused. Of several (compare, the benches), those
    that cannot are returned, each with its rows' reason; the run is refused, with the first one's
    message, only when none can. Names that are not ports (the bench's baselines) count only for
    the device."""
    refused: dict[str, Refusal] = {}
    cpu.forced()  # KVPORTS_CPU, the CPU-route switch (shared/cpu.py): a bad value refused before any port loads

    def each(rule: Callable[[str], Refusal | None]) -> None:
        for framework in setup.frameworks:
            refusal = rule(framework) if framework in registry.PORTS and framework not in refused else None
            if refusal is not None:
                refused[framework] = refusal
        if setup.frameworks and all(framework in refused for framework in setup.frameworks):
            raise refused[setup.frameworks[0]]

    quant = check_quant(setup.dtype, setup.quant, names)
    each(lambda framework: precision_refusal(framework, setup.dtype, quant, names))
    each(lambda framework: quant_device_refusal(framework, quant, setup.device, names))
    N = check_range("tensor_parallel", setup.tensor_parallel, 1, names, MAX_TENSOR_PARALLEL)
    check_quant_split(quant, N, names)
    each(lambda framework: split_refusal(framework, N, setup.modes, names))
    check_heads(N, models, names)
    each(lambda framework: mode_refusal(framework, setup.modes, names))
    check_cpu_only(setup.device, setup.frameworks, shown(names, "device", setup.device))
    if "speculative" in setup.modes:
        for _, draft in models[1:]:
            check_draft_model(models[0][1], draft)
    if models:
        check_logprobs(setup.logprobs, setup.modes, models[0][1].vocab_size, names)
    return {framework: refusal.reason for framework, refusal in refused.items()}


def check_quant(dtype: str, quant: object, names: Names = COMMAND_LINE) -> str:
    """A quant kvports has, over float32 or bfloat16 activations: the quant."""
    quant = check_choice("quant", quant, QUANTS, names)
    if quant_over_float64(dtype, quant):
        raise UserError(
            f"{shown(names, 'quant', quant)} needs float32 or bfloat16 activations, not "
            f"{shown(names, 'dtype', dtype)}: quantized weights have no float64 digits"
        )
    return quant


def quant_over_float64(dtype: str, quant: str) -> bool:
    return quant != "none" and dtype == "float64"


def offers(framework: str, dtype: str, quant: str) -> bool:
    """Whether `framework` runs this dtype and quant (what the bench's lists keep, pair by pair)."""
    return not quant_over_float64(dtype, quant) and missing_precision(framework, dtype, quant) is None


def precision_refusal(framework: str, dtype: str, quant: str, names: Names = COMMAND_LINE) -> Refusal | None:
    """--dtype bfloat16 and --quant only where the framework offers them: the same line for every port."""
    missing = missing_precision(framework, dtype, quant)
    if missing is None:
        return None
    offered = [name for name, precisions in PRECISIONS.items() if missing in precisions]
    field = "dtype" if missing == dtype else "quant"
    return Refusal(
        f"{shown(names, field, missing)} is offered by {', '.join(offered)} only, where the framework has a fast "
        f"{missing} product",
        f"no {missing}",
    )


# torch's packed int8 and 4-bit products (aten._weight_int8pack_mm, _weight_int4pack_mm_for_cpu) are
# CPU kernels: on a GPU they would fail inside the first forward instead of here.
CPU_QUANTS = {"torch": ("int8", "q4")}


def quant_device_refusal(framework: str, quant: str, device: str, names: Names = COMMAND_LINE) -> Refusal | None:
    """A quant whose product this framework has on the CPU only, asked of a GPU."""
    if device == "cpu" or quant not in CPU_QUANTS.get(framework, ()):
        return None
    return Refusal(
        f"{shown(names, 'quant', quant)} runs on the CPU in {framework} (its packed {quant} product is a CPU "
        f"kernel): give it without {shown(names, 'device', device)}",
        f"{quant} on the CPU only",
    )


def check_quant_split(quant: str, tensor_parallel: int, names: Names = COMMAND_LINE) -> None:
    """The ranks shard float Linear layers; a packed one has no plan to split it by."""
    if quant != "none" and tensor_parallel > 1:
        raise UserError(
            f"{shown(names, 'quant', quant)} runs on one device: give it without "
            f"{shown(names, 'tensor_parallel', tensor_parallel)}"
        )


def split_refusal(framework: str, tensor_parallel: int, modes: Sequence[str], names: Names) -> Refusal | None:
    """Split across N > 1 devices: a port that splits, in each of the run's modes (SPLIT_MODES)."""
    if tensor_parallel < 2:
        return None
    split = shown(names, "tensor_parallel", tensor_parallel)
    if not registry.SPLIT_MODES[framework]:
        splitting = " or ".join(name for name, modes in registry.SPLIT_MODES.items() if modes)
        return Refusal(f"{framework} has no tensor parallelism; {split} needs {splitting}", "no tensor parallelism")
    for mode in modes:
        if mode not in registry.SPLIT_MODES[framework]:
            offering = ", ".join(name for name, split_modes in registry.SPLIT_MODES.items() if mode in split_modes)
            where, what = MODE_WORDS.get(mode, (shown(names, "mode", mode), f"{mode} mode"))
            return Refusal(
                f"{split} in {where} runs on {offering} only: {framework}'s ranks have no {what}",
                f"no {what} across devices",
            )
    return None


# How a message names a mode no flag chooses: (where it runs, what a port lacks without it).
MODE_WORDS = {"paged": ("batch", "paged cache")}


def check_heads(tensor_parallel: int, models: Sequence[tuple[str, ModelConfig]], names: Names) -> None:
    """Every model run (the model, and a draft model) must split into N whole sets of query heads
    and N equal slices of its FFN width; its key/value heads are split the same way when N divides
    them, or each one copied to the devices whose query heads read it when they divide N (as vLLM does)."""
    split = shown(names, "tensor_parallel", tensor_parallel)
    for name, config in models if tensor_parallel > 1 else ():
        if config.n_heads % tensor_parallel or config.ffn_dim % tensor_parallel:
            raise UserError(
                f"{split} must divide {name}'s query heads (n_heads {config.n_heads}) and its FFN width "
                f"(ffn_dim {config.ffn_dim}): each device takes whole heads and an equal slice of the FFN"
            )
        if kv_layout(config, tensor_parallel) is None:
            raise UserError(
                f"{split} and {name}'s key/value heads (n_kv_heads {config.kv_heads}) must divide one another: "
                "the heads are split across the devices, or each copied to the devices that read it"
            )


def mode_refusal(framework: str, modes: Sequence[str], names: Names) -> Refusal | None:
    """Each of the run's modes offered by the port (registry.MODES)."""
    for mode in modes:
        if mode not in registry.MODES[framework]:
            offering = ", ".join(name for name, offered in registry.MODES.items() if mode in offered)
            return Refusal(
                f"{shown(names, 'mode', mode)} is offered by {offering} only: {framework} has no {mode} mode",
                f"no {mode} mode",
            )
    return None
