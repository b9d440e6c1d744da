"""The server's Prometheus metrics (prometheus-client, in a registry of its own): `GET /metrics`.

The engine's loop sets them after every step; prometheus-client's metrics take updates from any thread.
"""

from __future__ import annotations

from typing import Any

# Seconds: a tiny model's token on a GPU to a large prompt's first token on a busy CPU.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PREFIX = "kvports"


class Metrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        registry = self.registry
        self.running = Gauge(f"{PREFIX}_requests_running", "Requests in the running batch", registry=registry)
        self.waiting = Gauge(f"{PREFIX}_requests_waiting", "Requests waiting for room in the batch", registry=registry)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of admitted requests", registry=registry)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Tokens generated", registry=registry)
        self.prefill_tokens = Counter(
            f"{PREFIX}_prefill_computed_tokens", "Prompt tokens prefill steps computed", registry=registry
        )
        self.prefix_hits = Counter(
            f"{PREFIX}_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache", registry=registry
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "From a request's arrival to its first token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Between a request's successive tokens",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.blocks_used = Gauge(f"{PREFIX}_kv_blocks_used", "KV cache blocks held by requests", registry=registry)
        self.blocks_free = Gauge(f"{PREFIX}_kv_blocks_free", "KV cache blocks free", registry=registry)
        self.finished = Counter(
            f"{PREFIX}_requests_finished", "Requests ended, by reason", ["finish_reason"], registry=registry
        )
        self.rejected = Counter(
            f"{PREFIX}_requests_rejected", "Requests refused with 429 (queue full)", registry=registry
        )
        # The engine's own step timings (kvports bench --serve reads where a server's time goes).
        self.step_seconds = Counter(
            f"{PREFIX}_engine_step_seconds", "Seconds in the port's steps, by kind", ["kind"], registry=registry
        )
        self.steps = Counter(f"{PREFIX}_engine_steps", "Engine steps, by kind", ["kind"], registry=registry)
        self.seen: dict[str, float] = {"prefill": 0, "cached": 0}  # the engine's totals already counted

    def engine(self, engine: Any, waiting_outside: int) -> None:
        """The engine's state after a step: its batch, its queue (and requests not yet handed to it), its blocks."""
        scheduler, stats = engine.scheduler, engine.stats
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting) + waiting_outside)
        self.blocks_used.set(engine.blocks.num_used)
        self.blocks_free.set(engine.blocks.num_free)
        totals = {"prefill": stats.prefill_tokens, "cached": stats.cached_tokens}
        for kind in ("prefill", "decode"):
            totals[f"{kind} seconds"], totals[f"{kind} steps"] = stats.seconds[kind], stats.steps[kind]
        self.prefill_tokens.inc(totals["prefill"] - self.seen["prefill"])
        self.prefix_hits.inc(totals["cached"] - self.seen["cached"])
        for kind in ("prefill", "decode"):
            self.step_seconds.labels(kind).inc(totals[f"{kind} seconds"] - self.seen.get(f"{kind} seconds", 0))
            self.steps.labels(kind).inc(totals[f"{kind} steps"] - self.seen.get(f"{kind} steps", 0))
        self.seen = totals

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
