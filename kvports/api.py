"""The Python API: `kvports.load(framework, weights)` and the model's `generate(...)`.

    import kvports
    model = kvports.load("numpy")                  # the seed's model; or load("torch", "model.safetensors")
    out = model.generate([160, 248, 104, 209, 394], new_tokens=8)
    out.generated                                  # [[315, 391, 221, 120, 342, 371, 223, 418]]

Every argument goes through the command line's own checks (`kvports generate`'s parser, then
the same functions it calls), so a bad one raises `kvports.UserError` with the message the
command line prints after `error:`, the flag named as the command line names it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvports.shared.cli import build_parser
from kvports.shared.commands import generate as generate_command
from kvports.shared.commands.arguments import checked_prompts, generation_from, load_draft, load_weights_argument
from kvports.shared.config import ModelConfig
from kvports.shared.contract import Port
from kvports.shared.errors import UserError
from kvports.shared.generation import finish_reasons, row_tokens

__all__ = ["Generation", "Model", "UserError", "load"]

Prompts = str | Sequence[int] | Sequence[str | Sequence[int]] | np.ndarray | None


@dataclass(frozen=True)
class Generation:
    """What one `generate` call made, row by row (padding dropped)."""

    tokens: list[list[int]]  # each row's prompt, then what it generated
    generated: list[list[int]]  # what each row generated (a stopped row ends with its stop token)
    finish_reason: list[str]  # "stop" (a stop token) or "length" (new_tokens reached)
    logits: np.ndarray | None  # [B, steps, V] with return_logits=True (naive and cached)
    speculative: dict[str, Any] | None  # mode "speculative": proposals, acceptances, target forwards per token
    seconds: float


class Model:
    """One framework's model on one device, loaded and checked by `kvports.load`."""

    def __init__(self, port: Port, model: Any, config: ModelConfig, framework: str, dtype: str, device: str):
        self.port, self.model, self.config = port, model, config
        self.framework, self.dtype, self.device = framework, dtype, device

    def __repr__(self) -> str:
        return f"<kvports.Model {self.framework} {self.config.family} {self.dtype} on the {self.device}>"

    def generate(
        self,
        prompts: Prompts = None,
        new_tokens: int = 100,
        mode: str = "cached",
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_ids: Sequence[int] | None = None,
        draft: str | os.PathLike | None = None,
        draft_tokens: int = 4,
        ngram: int = 2,
        return_logits: bool = False,
        on_token: Callable[[np.ndarray], None] | None = None,
    ) -> Generation:
        """Generate from `prompts`: one prompt (ids, or "1,2,3" as the command line writes it) or a
        batch of them (rows may differ in length); None: the seed's prompt. mode: "naive", "cached"
        or "speculative" (with draft: a weights file or "ngram"). stop_ids: None for the model's eos
        ids, [] for none. on_token(token [B]) as each token reaches the host."""
        argv = [f"--framework={self.framework}", f"--mode={mode}", f"--new-tokens={new_tokens}"]
        argv += [f"--temperature={temperature}", f"--top-k={top_k}", f"--top-p={top_p}", f"--seed={seed}"]
        argv += [f"--prompt={text}" for text in prompt_texts(prompts)]
        if stop_ids is not None:
            argv += [f"--stop-id={stop}" for stop in stop_ids] or ["--no-stop"]
        if draft is not None:
            argv.append(f"--draft={os.fspath(draft)}")
        argv += [f"--draft-tokens={draft_tokens}", f"--ngram={ngram}", f"--dtype={self.dtype}"]
        args = parse_generate_flags([*argv, f"--device={self.device}"])
        prompt_batch = checked_prompts(args, self.config)
        generation = generation_from(args, self.config)
        draft_weights = load_draft(args, self.config, prompt_batch) if args.mode == "speculative" else None
        done = generate_command.run_generation(
            self.port, self.model, prompt_batch, generation, args, draft_weights, return_logits, on_token
        )
        P = prompt_batch.shape[1]
        rows, prompt_rows = row_tokens(done.tokens), row_tokens(prompt_batch)
        summary = None
        if done.counts is not None:
            summary = generate_command.speculative_summary(
                done.counts, str(args.draft), args.draft_tokens, done.tokens, P
            )
        return Generation(
            tokens=rows,
            generated=[row[len(prompt) :] for row, prompt in zip(rows, prompt_rows, strict=True)],
            finish_reason=finish_reasons(done.tokens, P, generation.stop_ids),
            logits=done.logits,
            speculative=summary,
            seconds=done.seconds,
        )


def parse_generate_flags(argv: list[str]) -> Any:
    """`kvports generate`'s flags, parsed by the command line's own parser: its refusals are
    UserErrors worded as the command line words them."""
    return build_parser().parse_args(["generate", *argv])


def prompt_texts(prompts: Prompts) -> list[str]:
    """Prompts as the command line's --prompt texts, so that they meet its checks and messages."""
    if prompts is None:
        return []
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    items = list(prompts)
    if items and all(isinstance(item, (str, list, tuple, np.ndarray)) for item in items):
        return [item if isinstance(item, str) else ",".join(str(token) for token in item) for item in items]
    return [",".join(str(token) for token in items)]


def load(
    framework: str, weights: str | os.PathLike | None = None, dtype: str = "float32", device: str = "cpu"
) -> Model:
    """A framework's ("torch", "jax" or "numpy") model from a weights file (None: the seed's model),
    in float32 or float64, on the "cpu" or a "gpu", checked as `kvports generate` checks them."""
    argv = [f"--framework={framework}", "--mode=cached", f"--dtype={dtype}", f"--device={device}"]
    if weights is not None:
        argv.append(f"--weights={os.fspath(weights)}")
    args = parse_generate_flags(argv)
    config, tensors = load_weights_argument(args)
    port = generate_command.load_port_for(args)
    return Model(port, port.load_model(config, tensors, args.dtype, args.device), config, framework, dtype, device)
