"""The engine: the scheduler's steps run by one port over its block pool, timed and counted.

Framework-free: the port is reached through two calls at the end of its port.py,
`init_block_pool` and `paged_step`, with NumPy in and out.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvports.batching.blocks import BlockManager, blocks_for
from kvports.batching.constraint import Grammars, allowed_rows
from kvports.batching.request import Request, check_request
from kvports.batching.scheduler import Scheduler, Sequence, Step, TokenLogprobs
from kvports.shared.checks import check_count
from kvports.shared.config import MAX_SIZE, ModelConfig, host_dtype
from kvports.shared.contract import Port
from kvports.shared.errors import NonFiniteLogits, UserError, echo
from kvports.shared.generation import PAD
from kvports.shared.shapes import parameter_count

BLOCK_SIZE = 16
MAX_BATCH = 32
MAX_STEP_TOKENS = 4096


@dataclass(frozen=True)
class BatchSettings:
    max_batch: int = MAX_BATCH  # sequences running at once
    block_size: int = BLOCK_SIZE  # token slots per block
    num_blocks: int | None = None  # None: enough for max_batch sequences of max_length (no preemption)
    max_step_tokens: int = MAX_STEP_TOKENS  # a prefill step's padded [B, T] budget
    prefix_caching: bool = True
    max_length: int | None = None  # the longest sequence (prompt + new tokens); None: the model's max_seq_len

    def validate(self, config: ModelConfig) -> BatchSettings:
        for name in ("max_batch", "block_size", "max_step_tokens", "num_blocks", "max_length"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise UserError(f"{name.replace('_', ' ')} {echo(value)} must be an integer >= 1")
            if value is not None:
                check_count(name.replace("_", " "), value)
        # JAX indexes the pool's slots and each step's [B, T] block in int32.
        # By default the pool holds max_batch whole sequences: a long context is told the flags that size it.
        slots = self.pool_blocks(config) * self.block_size
        if slots > MAX_SIZE:
            default = f" (by default --max-batch {self.max_batch} sequences of {self.longest(config)} tokens)"
            raise UserError(
                f"pool slots (num blocks x block size) {slots} is above {MAX_SIZE}: set a smaller pool with "
                f"--num-blocks{default if self.num_blocks is None else ''}"
            )
        check_count(
            "a step's rows x tokens (--max-batch x its longest)",
            self.max_batch * max(self.max_step_tokens, self.longest(config)),
        )
        if self.max_length is not None and self.max_length > config.max_seq_len:
            raise UserError(f"max length {self.max_length} exceeds max_seq_len {config.max_seq_len}")
        return self

    def longest(self, config: ModelConfig) -> int:
        return config.max_seq_len if self.max_length is None else self.max_length

    def pool_blocks(self, config: ModelConfig) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        return self.max_batch * blocks_for(self.longest(config), self.block_size)


def run_bytes(config: ModelConfig, dtype: str, settings: BatchSettings) -> dict[str, int]:
    """What a batch run cannot do without (kvports.limits' rule: a floor, not a ceiling): the weights
    twice, the block pool, each row's blocks gathered for one layer, and the widest step's logits
    and attention scores (a prefill step's [B, T] up to the budget, or one prompt that exceeds it)."""
    itemsize = np.dtype(host_dtype(dtype)).itemsize
    longest = settings.longest(config)
    slots = settings.pool_blocks(config) * settings.block_size
    gathered = settings.max_batch * blocks_for(longest, settings.block_size) * settings.block_size
    step_tokens = max(settings.max_step_tokens, longest)
    return {
        "weights": 2 * parameter_count(config) * itemsize,
        "block pool": 2 * config.n_layers * slots * config.kv_heads * config.head_dim * itemsize,  # no ring
        "gathered blocks": 2 * gathered * config.kv_heads * config.head_dim * itemsize,
        "logits": step_tokens * config.vocab_size * itemsize,
        "attention scores": step_tokens * config.n_heads * longest * itemsize,
    }


@dataclass
class EngineStats:
    steps: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    prefill_tokens: int = 0  # tokens a prefill step computed (prompts past their cached prefix, recomputations)
    padded_prefill_tokens: int = 0  # the [B, T] blocks prefill steps ran, padding included
    cached_tokens: int = 0  # tokens admissions found in the prefix cache
    decode_tokens: int = 0
    preemptions: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0, "decode": 0.0})  # in the port's step

    @property
    def prefix_hit_rate(self) -> float:
        """The share of the tokens prefill needed that the prefix cache already held."""
        needed = self.prefill_tokens + self.cached_tokens
        return self.cached_tokens / needed if needed else 0.0

    def count(self, step: Step, seconds: float) -> None:
        self.steps[step.kind] += 1
        self.seconds[step.kind] += seconds
        if step.kind == "prefill":
            self.prefill_tokens += step.computed_tokens
            self.padded_prefill_tokens += step.tokens.size
            self.cached_tokens += sum(int(start) for start in step.start)
        else:
            self.decode_tokens += len(step.sequences)


def check_step(step: Step, next_tokens: np.ndarray, dtype: str) -> None:
    """A row the port gave PAD had logits with an inf or a NaN (finite weights can overflow a forward):
    the run stops, naming the first such request and the step (its token) that overflowed."""
    for sequence, token in zip(step.sequences, next_tokens, strict=True):
        if int(token) == PAD:
            raise NonFiniteLogits(len(sequence.generated), f"request {sequence.request.id!r}", dtype)


def wants_prompt_logprobs(sequence: Sequence) -> bool:
    """A sequence whose prompt's own log-probabilities this prefill computes: asked, not yet kept
    (a preempted sequence's recomputation keeps none), and its whole prompt in the step."""
    return sequence.request.prompt_logprobs is not None and not sequence.prompt_logprobs and sequence.computed == 0


def keep_logprobs(step: Step, next_tokens: np.ndarray, steps: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    """Each row that asked keeps its new token's log-probability and its own count of the step's
    likeliest tokens (the step computed the most any row asked for); with every position's (a
    prefill that a prompt's own log-probabilities were asked of), its prompt's too."""
    chosen, top_ids, top_logprobs = steps  # [B], [B, K], [B, K]; every position's: [B, T], [B, T, K]
    if chosen.ndim == 2:
        keep_prompt_logprobs(step, steps)
        chosen, top_ids, top_logprobs = chosen[:, -1], top_ids[:, -1], top_logprobs[:, -1]  # [B], [B, K], [B, K]
    for row, (sequence, token) in enumerate(zip(step.sequences, next_tokens, strict=True)):
        count = sequence.request.logprobs
        if count is None or int(token) == PAD:  # PAD: the row ends with an error, no token
            continue
        top = tuple((int(i), float(p)) for i, p in zip(top_ids[row, :count], top_logprobs[row, :count], strict=True))
        sequence.logprobs.append(TokenLogprobs(int(token), float(chosen[row]), top))


def keep_prompt_logprobs(step: Step, steps: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    """Each asking row's prompt tokens after the first: position t's log-probability of the token at
    t + 1, and its request's count of likeliest tokens there."""
    chosen, top_ids, top_logprobs = steps  # [B, T], [B, T, K], [B, T, K]
    T = step.tokens.shape[1]
    for row, sequence in enumerate(step.sequences):
        count = sequence.request.prompt_logprobs
        if count is None or not wants_prompt_logprobs(sequence):
            continue
        prompt = sequence.request.prompt
        first = T - len(prompt)  # the column of the prompt's first token (left padding before it)
        for index in range(1, len(prompt)):
            column = first + index - 1  # the position whose logits score prompt[index]
            top = tuple(
                (int(i), float(p))
                for i, p in zip(top_ids[row, column, :count], top_logprobs[row, column, :count], strict=True)
            )
            sequence.prompt_logprobs.append(TokenLogprobs(prompt[index], float(chosen[row, column]), top))


class Engine:
    def __init__(
        self,
        port: Port,
        model: Any,
        config: ModelConfig,
        settings: BatchSettings = BatchSettings(),
        clock: Callable[[], float] = time.perf_counter,
        *,
        dtype: str = "float32",
        end_nonfinite_rows: bool = False,
        grammars: Grammars | None = None,
    ):
        self.port, self.model, self.config = port, model, config
        self.dtype = dtype  # the model's, named when a step's logits overflow it
        # True (a server): a row whose logits overflowed ends alone (reason "error"), the others run on.
        # False (a batch file): the step raises NonFiniteLogits, ending every request.
        self.end_nonfinite_rows = end_nonfinite_rows
        # The model's tokenizer as llguidance's, for requests with a response format; None: none taken.
        self.grammars = grammars
        self.settings = settings.validate(config)
        self.clock = clock
        self.blocks = BlockManager(settings.pool_blocks(config), settings.block_size, settings.prefix_caching)
        self.scheduler = Scheduler(self.blocks, settings.max_batch, settings.max_step_tokens)
        self.stats = EngineStats()
        self.pool: Any = None  # made on the first step: a failed step may leave the old one unusable (JAX donates it)

    def add(self, request: Request) -> Sequence:
        """Queue a request (at any time, also while others run), held to `check_request` with the
        engine's longest sequence (its door checked it already, in its own words)."""
        check_request(request, self.config, max_tokens=self.settings.longest(self.config))
        sequence = Sequence(request, arrival=self.clock())
        if request.response_format is not None:
            if self.grammars is None:
                raise UserError("a response format needs the model's tokenizer: this engine has none")
            sequence.matcher = self.grammars.matcher(request.response_format)
        self.scheduler.add(sequence)
        return sequence

    def cancel(self, sequence: Sequence, reason: str = "cancelled") -> None:
        """End a queued or running request now (its client went away), its blocks back at once."""
        self.scheduler.cancel(sequence, self.clock(), reason)

    @property
    def idle(self) -> bool:
        return self.scheduler.idle

    def step(self) -> list[Sequence]:
        """Run one step; the sequences it finished. A failing step ends every sequence (reason
        "error"), returns every block and re-raises."""
        step = self.scheduler.schedule()
        if step is None:
            return []
        try:
            self.make_pool()
            started = self.clock()
            # The most likeliest tokens a row asks for; None (nothing computed) when no row asks.
            every_position = step.kind == "prefill" and any(wants_prompt_logprobs(row) for row in step.sequences)
            counts = [row.request.logprobs for row in step.sequences]
            if every_position:
                counts += [row.request.prompt_logprobs for row in step.sequences]
            top = max((count for count in counts if count is not None), default=None)
            # Each constrained row's grammar masks its logits: computed here on the host, once per step.
            allowed = allowed_rows([row.matcher for row in step.sequences], self.config.vocab_size)  # [B, V] or None
            if allowed is not None:
                step.sampling = dataclasses.replace(step.sampling, allowed=allowed)
            next_tokens, self.pool, steps = self.port.paged_step(
                self.model, self.pool, step.tokens, step.start, step.block_tables, step.sampling, top, every_position
            )
            if not self.end_nonfinite_rows:
                check_step(step, next_tokens, self.dtype)
        except BaseException:
            self.pool = None
            self.scheduler.abort_all(self.clock())
            raise
        self.stats.count(step, self.clock() - started)
        self.stats.preemptions = self.scheduler.preemptions
        if steps is not None:
            keep_logprobs(step, next_tokens, steps)
        failed = self.end_failed_rows(step, next_tokens)
        if failed:
            good = [row for row, sequence in enumerate(step.sequences) if sequence not in failed]
            step = dataclasses.replace(step, sequences=[step.sequences[row] for row in good])
            next_tokens = next_tokens[good]  # [B']
        return failed + self.scheduler.finish_step(step, next_tokens, self.clock())

    def make_pool(self) -> None:
        if self.pool is None:
            self.pool = self.port.init_block_pool(
                self.model,
                self.blocks.num_blocks,
                self.blocks.block_size,
                self.settings.max_batch,
                blocks_for(self.settings.longest(self.config), self.blocks.block_size),
            )

    def compile_steps(self, on_compiled: Callable[[int, int], None] | None = None) -> int:
        """Compile every program this engine's steps can run (JAX), before the first request waits on
        one; how many programs. on_compiled(done, total) after each."""
        self.make_pool()
        return self.port.compile_paged_steps(
            self.model, self.pool, self.settings.max_step_tokens, self.settings.longest(self.config), on_compiled
        )

    def end_failed_rows(self, step: Step, next_tokens: np.ndarray) -> list[Sequence]:
        """The rows the port gave PAD (their logits held an inf or a NaN), ended with reason "error"
        when the engine ends such rows alone. The prefix hashes go: those rows' blocks may hold
        non-finite keys, and a later prompt must not find them."""
        if not self.end_nonfinite_rows:
            return []
        failed = [sequence for sequence, token in zip(step.sequences, next_tokens, strict=True) if int(token) == PAD]
        for sequence in failed:
            self.scheduler.cancel(sequence, self.clock(), "error")
        if failed:
            self.blocks.forget_prefixes()
        return failed

    def run(self, on_finish: Callable[[Sequence], None] | None = None) -> list[Sequence]:
        """Step until every queued request has finished; the finished sequences in finishing order."""
        finished: list[Sequence] = []
        while not self.idle:
            for sequence in self.step():
                finished.append(sequence)
                if on_finish is not None:
                    on_finish(sequence)
        return finished
