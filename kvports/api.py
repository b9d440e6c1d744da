"""The Python API: `kvports.load(framework, weights)` and the model's `generate(...)`, `chat(...)`
and `stream(...)`.

    import kvports
    model = kvports.load("numpy")                  # the seed's model; or load("torch", "model.safetensors")
    out = model.generate([160, 248, 104, 209, 394], new_tokens=8)
    out.generated                                  # [[315, 391, 221, 120, 342, 371, 223, 418]]
    model.generate(prompts, kvports.GenerationConfig(8, temperature=0.8))  # nano-vllm's shape
    smol = kvports.load("numpy", model="smollm2")  # a model with a tokenizer: words in, words out
    smol.chat([{"role": "user", "content": "What is the capital of France?"}]).answer[0]
    for piece in smol.stream("Once upon a time"): print(piece, end="")

Both go straight to the run layer (`kvports.loading`, `kvports.generating`) that the command line parses its flags into:
the same checks, run once, and the same messages, except that a message names this API's
argument (`new_tokens=0`) where the command line names its flag (`--new-tokens`).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvports import generating, loading
from kvports.batching.constraint import parse_response_format
from kvports.generating import Generation
from kvports.shared.checks import API
from kvports.shared.contract import OnToken
from kvports.shared.errors import NonFiniteLogits, UserError, echo, echo_path
from kvports.shared.generation import GenerationConfig
from kvports.threads import check_threads, use_threads
from kvports.validation import SEED_PROMPT, Setup, bounded_ids, bounded_prompts, parse_prompt

Messages = Sequence[dict[str, str]]

__all__ = ["Generation", "GenerationConfig", "Model", "UserError", "load"]

Prompts = str | Sequence[int] | Sequence[str | Sequence[int]] | np.ndarray | None


class Model:
    """One framework's model on one device, loaded and checked by `kvports.load`; the draft models
    of speculative calls are read and loaded once, then kept here."""

    def __init__(self, loaded: loading.LoadedModel, weights: Path | None = None):
        self.loaded, self.weights = loaded, weights
        self.framework, self.dtype, self.device = loaded.framework, loaded.dtype, loaded.device
        self.config = loaded.config
        self._tokenizer: list[Any] = []  # [the tokenizer or None], read on first use

    @property
    def tokenizer(self) -> Any:
        """The weights' own tokenizer (a GGUF file's, or tokenizer.json beside a converted file), or None."""
        if not self._tokenizer:
            self._tokenizer.append(loading.model_tokenizer(self.weights, self.config))
        return self._tokenizer[0]

    def __repr__(self) -> str:
        return f"<kvports.Model {self.framework} {self.config.family} {self.dtype} on the {self.device}>"

    def generate(
        self,
        prompts: Prompts | ChatPrompt = None,
        generation: GenerationConfig | int | None = None,
        mode: str = "cached",
        *,
        new_tokens: int = 100,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_ids: Sequence[int] | None = None,
        draft: str | os.PathLike | None = None,
        draft_tokens: int = 4,
        ngram: int = 2,
        return_logits: bool = False,
        on_token: OnToken | None = None,
        logprobs: int = 0,
        num_samples: int = 1,
        response_format: dict[str, Any] | None = None,
    ) -> Generation:
        """Generate from `prompts`: one prompt (ids, or "1,2,3" as the command line writes it) or a
        batch of them (rows may differ in length); None: the seed's prompt. `generation`: a
        GenerationConfig (its stop_ids are used as given), a number of new tokens, or else the keywords new_tokens,
        temperature, top_k, top_p, seed and stop_ids (None: the model's eos ids; []: none).
        mode: "naive", "cached" or "speculative" (with draft: a weights file or "ngram").
        on_token(token [B]) as each token reaches the host. logprobs=K (naive and cached, K <= 20):
        each new token's log-probability and its step's K likeliest, as `.logprobs`. num_samples: each
        prompt that many times, seeded seed, seed + 1, ... (a row's draws depend on its seed, not its
        place in the batch; GenerationConfig(seeds=...) gives each prompt its own). response_format:
        OpenAI's, as a request body gives it ({"type": "json_object"}, or {"type": "json_schema",
        "json_schema": {"name": ..., "schema": {...}}}): each row's answer is JSON (that the schema
        describes), mode cached, through the batching engine as the server's requests are."""
        check_arguments(stop_ids=stop_ids, draft=draft, return_logits=return_logits, on_token=on_token)
        if generation is None or (isinstance(generation, int) and not isinstance(generation, bool)):
            new_tokens = new_tokens if generation is None else generation
            stops = self.config.eos_token_ids if stop_ids is None else tuple(bounded_ids("stop_ids", stop_ids))
            generation = GenerationConfig(new_tokens, temperature, top_k, top_p, seed, tuple(dict.fromkeys(stops)))
        elif not isinstance(generation, GenerationConfig):
            raise UserError(f"generation={echo(generation)} is not a GenerationConfig")
        chosen = None if draft is None else generating.Draft(os.fspath(draft), draft_tokens, ngram)
        inputs = generating.RunInputs(
            self.framework,
            mode,
            generation,
            None,
            self.dtype,
            self.device,
            chosen,
            quant=self.loaded.quant,
            tensor_parallel=self.loaded.tensor_parallel,
            logprobs=logprobs,
            response_format=parse_response_format(response_format, API),
        )
        rows = prompt_rows(prompts, self.tokenizer) if not isinstance(prompts, ChatPrompt) else [prompts.ids]
        inputs, rows = generating.with_samples(inputs, rows, num_samples, API)
        batch = generating.check_and_prepare(self.loaded, inputs, rows, API)
        try:
            return generating.generate(self.loaded, batch, inputs, return_logits, on_token, self.tokenizer)
        except NonFiniteLogits as exc:  # the command line's message names its flag; this API names its argument
            raise NonFiniteLogits(exc.step, exc.where, exc.dtype, "dtype='float64'") from None

    def chat(self, messages: Messages, generation: GenerationConfig | int | None = None, **options: Any) -> Generation:
        """One conversation ([{"role", "content"}, ...]) rendered by the model's own chat template, with
        the prompt that opens the assistant's turn, then `generate`'s with its options; the reply is
        `.answer[0]` (special tokens left out)."""
        return self.generate(self.templated(messages), generation, **options)

    def templated(self, messages: Messages) -> ChatPrompt:
        """A conversation's prompt ids in the model's chat template (`batching.request.chat_prompt`)."""
        from kvports.batching.request import chat_prompt

        if self.tokenizer is None:
            raise UserError(f"messages need a model with a tokenizer and a chat template; {self.describe()} has none")
        given = list(messages) if isinstance(messages, (list, tuple)) else messages
        return ChatPrompt(
            chat_prompt(given, lambda checked: loading.chat_ids(self.weights, checked, self.tokenizer), API)
        )

    def stream(
        self,
        prompt: str | Sequence[int] | None = None,
        generation: GenerationConfig | int | None = None,
        *,
        messages: Messages | None = None,
        **options: Any,
    ) -> Iterator[str]:
        """The answer's text in pieces, as its tokens arrive: `prompt` (text or ids, one row) or
        `messages` (a chat), and `generate`'s options. Decoded incrementally (the tokenizers library's
        DecodeStream), so a character of several bytes is never split across pieces; special tokens
        are left out. Stopping the iteration early stops the generation."""
        from tokenizers.decoders import DecodeStream

        if self.tokenizer is None:
            raise UserError(f"stream() yields text: it needs a model with a tokenizer; {self.describe()} has none")
        if messages is not None and prompt is not None:
            raise UserError("give stream() a prompt or messages=, not both")
        given = self.templated(messages) if messages is not None else prompt
        if given is not None and not isinstance(given, (str, ChatPrompt)) and len(prompt_rows(given)) != 1:
            raise UserError("stream() takes one prompt: ids, text or messages=, not a batch")
        check_arguments(on_token=options.get("on_token"))
        tokens: queue.Queue[Any] = queue.Queue()
        stopped = threading.Event()

        def heard(token: np.ndarray) -> None:  # token [1]
            if stopped.is_set():
                raise StreamClosed
            tokens.put(int(token[0]))

        def work() -> None:
            try:
                tokens.put(Done(self.generate(given, generation, on_token=heard, **options)))
            except BaseException as exc:  # handed to the reading thread, raised there
                tokens.put(exc)

        worker = threading.Thread(target=work, name="kvports-stream", daemon=True)
        worker.start()
        decoder = DecodeStream(skip_special_tokens=True)
        try:
            while True:
                item = tokens.get()
                if isinstance(item, Done):
                    return
                if isinstance(item, BaseException):
                    if isinstance(item, StreamClosed):
                        return
                    raise item
                piece = decoder.step(self.tokenizer, item)
                if piece:
                    yield piece
        finally:
            stopped.set()
            worker.join()

    def describe(self) -> str:
        return "the seed's model" if self.weights is None else echo_path(self.weights)


class ChatPrompt:
    """A chat's prompt, rendered and tokenized: the ids `generate` runs."""

    def __init__(self, ids: list[int]):
        self.ids = ids


class StreamClosed(Exception):
    """Raised in the generation's thread once the reader of a stream has stopped reading."""


class Done:
    def __init__(self, result: Generation):
        self.result = result


def check_arguments(**given: object) -> None:
    """The types of generate()'s and load()'s own arguments, named as the caller wrote them, before
    any is used: a string where ids belong would be read character by character, 123 as a path
    would be a TypeError from deep inside."""
    for name, value in given.items():
        if value is None:
            continue
        if name == "stop_ids" and (
            isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray, set, frozenset))
        ):
            raise UserError(f"stop_ids={echo(value)} is not a list of token ids")
        if name in ("weights", "draft") and not isinstance(value, (str, os.PathLike)):
            raise UserError(f"{name}={echo(value)} is not a path" + (" or 'ngram'" if name == "draft" else ""))
        if name == "model" and not isinstance(value, str):
            raise UserError(f"model={echo(value)} is not a model's name")
        if name == "return_logits" and not isinstance(value, (bool, np.bool_)):
            raise UserError(f"return_logits={echo(value)} is not True or False")
        if name == "on_token" and not callable(value):
            raise UserError(f"on_token={echo(value)} is not callable")
        if name == "prompts" and not isinstance(value, (str, Sequence, np.ndarray)):
            raise UserError(f"prompts={echo(value)} is not a prompt: ids, a batch of them, or '1,2,3'")


def prompt_rows(prompts: Prompts, tokenizer: Any = None) -> list[list[object]]:
    """Prompts as rows of ids: one row, a batch, "1,2,3" texts (read as the command line reads
    --prompt), an array, or None for the seed's prompt. With a tokenizer, a string that is not
    "1,2,3" ids is text, encoded as the command line's --text."""
    if prompts is None:
        return [list(SEED_PROMPT)]
    check_arguments(prompts=prompts)
    prompts = bounded_prompts(prompts)  # type: ignore[assignment]
    if isinstance(prompts, str):
        return [row_of(prompts, tokenizer)]
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    items = list(prompts)
    if not items:
        raise UserError("empty prompt: give at least one token id")
    if all(isinstance(item, (str, list, tuple, np.ndarray)) for item in items):
        return [row_of(item, tokenizer) if isinstance(item, str) else list(item) for item in items]
    return [items]


def row_of(text: str, tokenizer: Any) -> list[object]:
    """A string prompt: "1,2,3" ids, else (with a tokenizer) text encoded as --text is."""
    if tokenizer is not None:
        try:
            return list(parse_prompt(text))
        except UserError:
            from kvports.formats.hf.text import encode

            return list(encode(tokenizer, [text], "prompts")[0])
    return list(parse_prompt(text))


def load(
    framework: str,
    weights: str | os.PathLike | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    *,
    model: str | None = None,
    quant: str = "none",
    tensor_parallel: int = 1,
    threads: int | None = None,
) -> Model:
    """A framework's ("torch", "jax" or "numpy") model from a weights file, safetensors or GGUF
    (None: the seed's model), or a fetched model by name (`model="smollm2"`), in float32 or
    float64 (torch and JAX: bfloat16 too), on the "cpu" or a "gpu", checked as `kvports generate` checks
    them; quant "int8" or "q4" (a Q4_0/Q4_1 GGUF file's own blocks): weight-only quantization (torch and JAX);
    split across `tensor_parallel` devices (torch and JAX; on the CPU, processes or simulated devices)."""
    generating.check_names(framework, dtype, device, API)
    check_arguments(weights=weights, model=model)
    check_threads(threads, API)  # threads=N: every framework's thread count, set before it starts (kvports.threads)
    if model is not None:
        from kvports.hub import model_path

        if weights is not None:
            raise UserError("give weights= a file or model= a fetched model's name, not both")
        weights = model_path(model)
    setup = Setup((framework,), (), dtype, quant, device, tensor_parallel)
    path = None if weights is None else Path(os.fspath(weights))
    with loading.open_model(path) as file:
        config = loading.header(file, dtype)
        generating.check_load(setup, config, API)
        tensors = loading.read_tensors(file, dtype, quant, API)
    use_threads(threads)
    return Model(
        loading.load_model(
            framework, config, tensors, dtype, device, API, quant=quant, tensor_parallel=tensor_parallel
        ),
        path,
    )
