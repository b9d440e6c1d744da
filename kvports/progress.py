"""The progress bar `kvports compare` and `kvports bench` draw on stderr while they run."""

from __future__ import annotations

from typing import TYPE_CHECKING

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
