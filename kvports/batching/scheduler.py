"""The scheduler: which sequences run in the next step, and what that step feeds the model.

Two kinds of step, never mixed:
- a prefill step admits waiting sequences (first come, first served) while the batch has
  room (max_batch), the step's token budget holds and the pool has their blocks; it computes
  each one's prompt past its cached prefix and samples its first token.
- otherwise a decode step feeds every running sequence its last token. A sequence whose next
  token needs a block the pool no longer has preempts the newest running sequence (its blocks
  go back; it waits at the front of the queue and is recomputed later, its tokens unchanged).

Why separate: the model takes one [B, T] block of tokens per forward, so a decode row in a
prefill step would be padded to the step's longest prompt (T times its work). Prefill steps
are compute-bound and batch well among themselves; decode steps read every weight once for
all their rows.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvports.batching.blocks import BlockManager, blocks_for
from kvports.batching.constraint import Matcher
from kvports.batching.request import Request
from kvports.shared.errors import UserError
from kvports.shared.generation import PAD, GenerationConfig, RowSampling, uniforms

NO_BLOCK = -1  # a block table's padding past a row's last block: gathered, then masked
# The least share of a prefill step's [B, T] block that is real tokens, not padding. Where compute is the
# limit (a CPU), padding costs its full share while a step's fixed cost (reading the weights once) is small
# next to its prompts' compute: several tight steps beat one padded one.
MIN_FILL = 0.8


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability under the model (log-softmax of its step's raw logits) and
    the step's likeliest tokens, likeliest first, as many as its request asked for."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token, logprob) each


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request as it runs: its tokens so far and where their keys and values live."""

    request: Request
    arrival: float  # seconds on the engine's clock
    tokens: list[int] = field(default_factory=list)  # prompt, then each generated token
    block_table: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose keys and values are in the pool (the first `computed` of `tokens`)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache, summed over admissions
    preemptions: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per generated token, if its request asked
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per prompt token after the first, if asked
    matcher: Matcher | None = None  # its response format's grammar, walked token by token (the engine's)

    def __post_init__(self) -> None:
        self.tokens = list(self.request.prompt)
        # The draws of its seed's stream, as `kvports generate` draws them: its tokens do not depend on its neighbours.
        gen = self.request.generation
        self.draws = uniforms(gen.row_seeds(1), gen.max_new_tokens)[0] if not gen.greedy else None  # [N]

    @property
    def generation(self) -> GenerationConfig:
        return self.request.generation

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.request.prompt) :]

    @property
    def max_length(self) -> int:
        return self.request.max_length


@dataclass
class Step:
    """One forward's inputs, as the ports take them (NumPy)."""

    kind: str  # "prefill" or "decode"
    sequences: list[Sequence]
    tokens: np.ndarray  # [B, T] int64, each row's uncomputed tokens, PAD on the left of shorter rows
    start: np.ndarray  # [B] int64: each row's tokens already in the pool (its first new position)
    block_tables: np.ndarray  # [B, M] int64, NO_BLOCK past a row's last block
    sampling: RowSampling  # each row's temperature, top-k, top-p and draw [B] (temperature 0 where greedy)

    @property
    def computed_tokens(self) -> int:
        return int((self.tokens != PAD).sum())


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch: int, max_step_tokens: int):
        if max_batch < 1:
            raise UserError(f"max batch {max_batch} is below 1")
        if max_step_tokens < 1:
            raise UserError(f"max step tokens {max_step_tokens} is below 1")
        self.blocks = blocks
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, sequence: Sequence) -> None:
        needed = blocks_for(sequence.max_length, self.blocks.block_size)
        if needed > self.blocks.num_blocks:
            raise UserError(
                f"request {sequence.request.id!r} needs {needed} blocks of {self.blocks.block_size} "
                f"tokens; the pool has {self.blocks.num_blocks}"
            )
        self.waiting.append(sequence)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> Step | None:
        """The next step, or None when there is nothing to run."""
        admitted = self.admit()
        if admitted:
            return self.make_step("prefill", admitted)
        if not self.running:
            return None
        return self.make_step("decode", self.reserve_decode_slots())

    def admit(self) -> list[Sequence]:
        """Waiting sequences for one prefill step, first come first served. The step computes a padded
        [B, T] block: it stays within the token budget (a lone prompt longer than the budget still
        runs) and at least MIN_FILL of it is real tokens (a short prompt after a long one waits for
        the next step rather than be padded to the long one's length)."""
        admitted: list[Sequence] = []
        longest = real = 0
        while self.waiting and len(self.running) < self.max_batch:
            sequence = self.waiting[0]
            reuse = sequence.request.prompt_logprobs is None  # every prompt position computed when asked
            cached_blocks = len(self.blocks.cached_prefix(sequence.tokens, reuse))
            uncached = len(sequence.tokens) - cached_blocks * self.blocks.block_size
            width = max(longest, uncached)
            padded = (len(admitted) + 1) * width
            if admitted and (padded > self.max_step_tokens or real + uncached < MIN_FILL * padded):
                break
            if not self.blocks.can_allocate(sequence.tokens, reuse):
                break  # first come first served: the head waits for blocks, nobody overtakes it
            self.waiting.popleft()
            sequence.block_table, cached = self.blocks.allocate(sequence.tokens, reuse)
            sequence.computed = cached
            sequence.cached_tokens += cached
            sequence.status = Status.RUNNING
            self.running.append(sequence)
            admitted.append(sequence)
            longest, real = width, real + uncached
        return admitted

    def reserve_decode_slots(self) -> list[Sequence]:
        """Every running sequence, each with a slot for the token it feeds; preempting the newest
        ones (last admitted first) while the pool is short."""
        scheduled: list[Sequence] = []
        queue = list(self.running)
        while queue:
            sequence = queue.pop(0)
            position = sequence.computed  # the slot its last token's keys and values go to
            while self.blocks.needs_block(sequence.block_table, position) and self.blocks.num_free == 0:
                victim = queue.pop() if queue else sequence
                self.preempt(victim)
                if victim is sequence:
                    break
            else:
                self.blocks.append_slot(sequence.block_table, sequence.tokens, position)
                scheduled.append(sequence)
        return scheduled

    def preempt(self, sequence: Sequence) -> None:
        self.blocks.free_table(sequence.block_table)
        sequence.block_table, sequence.computed = [], 0
        sequence.status = Status.WAITING
        sequence.preemptions += 1
        self.preemptions += 1
        self.running.remove(sequence)
        self.waiting.appendleft(sequence)

    def make_step(self, kind: str, sequences: list[Sequence]) -> Step:
        B = len(sequences)
        T = max(len(sequence.tokens) - sequence.computed for sequence in sequences)
        M = max(len(sequence.block_table) for sequence in sequences)
        tokens = np.full((B, T), PAD, dtype=np.int64)  # [B, T]
        block_tables = np.full((B, M), NO_BLOCK, dtype=np.int64)  # [B, M]
        uniform = np.zeros(B, dtype=np.float64)  # [B]
        for row, sequence in enumerate(sequences):
            new = sequence.tokens[sequence.computed :]
            tokens[row, T - len(new) :] = new
            block_tables[row, : len(sequence.block_table)] = sequence.block_table
            if sequence.draws is not None:
                uniform[row] = sequence.draws[len(sequence.generated)]
        start = np.asarray([sequence.computed for sequence in sequences], dtype=np.int64)  # [B]
        sampling = RowSampling.of([sequence.generation for sequence in sequences], uniform)  # [B] each
        return Step(kind, sequences, tokens, start, block_tables, sampling)

    def finish_step(self, step: Step, next_tokens: np.ndarray, now: float) -> list[Sequence]:
        """Take each row's new token; the sequences this step finished (their blocks freed)."""
        finished = []
        for sequence, token in zip(step.sequences, next_tokens, strict=True):
            sequence.computed = len(sequence.tokens)
            sequence.tokens.append(int(token))
            if sequence.first_token_time is None:
                sequence.first_token_time = now
            # A grammar that takes nothing more ends the answer as a stop id does (its last token kept).
            complete = sequence.matcher is not None and sequence.matcher.take(int(token))
            if int(token) in sequence.generation.stop_ids or complete:
                sequence.finish_reason = "stop"
            elif len(sequence.generated) == sequence.generation.max_new_tokens:
                sequence.finish_reason = "length"
            if sequence.finish_reason is not None:
                self.finish(sequence, now)
                finished.append(sequence)
        return finished

    def finish(self, sequence: Sequence, now: float) -> None:
        self.blocks.free_table(sequence.block_table)
        sequence.block_table = []
        sequence.status = Status.FINISHED
        sequence.finish_time = now
        if sequence in self.running:
            self.running.remove(sequence)

    def cancel(self, sequence: Sequence, now: float, reason: str = "cancelled") -> None:
        """End a sequence before its last token (its client went away, or its forward failed): out of
        the queue or the batch, its blocks back at once."""
        if sequence.status is Status.FINISHED:
            return
        if sequence.status is Status.WAITING:
            self.waiting.remove(sequence)
        sequence.finish_reason = reason
        self.finish(sequence, now)

    def abort_all(self, now: float) -> list[Sequence]:
        """After a failed step: every sequence ends (reason "error"), every block goes back, and no
        prefix stays findable (blocks registered for the failed step were never written)."""
        aborted = list(self.running) + list(self.waiting)
        for sequence in aborted:
            sequence.finish_reason = "error"
            self.finish(sequence, now)
        self.waiting.clear()
        self.blocks.forget_prefixes()
        return aborted
