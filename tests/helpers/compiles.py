"""JAX's compilations counted from outside, by its own monitoring events (one per trace of a jitted
function): what the tests of compiled generation, batching and chat hold to."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"


@contextlib.contextmanager
def counting_traces() -> Iterator[list[str]]:
    """The traces made inside the block, one entry each (JAX must be installed)."""
    import jax

    traces: list[str] = []

    def listener(event: str, duration: float, **kwargs: object) -> None:
        if event == TRACE_EVENT:
            traces.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield traces
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
