"""The progress bars `kvports compare` and `kvports bench` draw on stderr while they run, and a
slow load's (a GGUF file's first, dequantizing every tensor)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

T = TypeVar("T")

if TYPE_CHECKING:
    from rich.progress import Progress


def make_progress(quiet: bool) -> Progress:
    """A transient bar on stderr with the time elapsed and an estimate of the time left; off when
    `quiet` (machine-readable output) or stderr is no terminal."""
    # rich is imported here, not at the top: `kvports generate` never draws a bar.
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    console = Console(stderr=True)
    return Progress(
        TextColumn("{task.description:<14}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TextColumn("elapsed,"),
        TimeRemainingColumn(),
        TextColumn("left"),
        console=console,
        transient=True,
        disable=quiet or not console.is_terminal,
    )


@contextlib.contextmanager
def load_progress(total: int, what: str) -> Iterator[Callable[[Callable[[str], T]], Callable[[str], T]]]:
    """A bar for a load of `total` steps, drawn on stderr once it has taken a second (a quick load
    draws nothing) and only on a terminal. Yields `advance(read)`: `read` counting each call as a step."""
    start, done = time.perf_counter(), [0]
    bar: list[Any] = []

    def advance(read: Callable[[str], T]) -> Callable[[str], T]:
        def counted(name: str) -> T:
            value = read(name)
            done[0] += 1
            if not bar and time.perf_counter() - start > 1 and sys.stderr.isatty():
                progress = make_progress(quiet=False)
                progress.start()
                bar.append((progress, progress.add_task(what, total=total)))
            if bar:
                bar[0][0].update(bar[0][1], completed=done[0])
            return value

        return counted

    try:
        yield advance
    finally:
        if bar:
            bar[0][0].stop()
