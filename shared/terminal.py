"""Printing a wide table whole: rich would squeeze (and cut) columns to fit a narrow terminal,
or the 80 columns it assumes for a pipe."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console, RenderableType


def console_for(renderable: RenderableType) -> Console:
    """A stdout console at least as wide as the renderable needs (the terminal's width if wider)."""
    from rich.console import Console
    from rich.measure import Measurement

    console = Console()
    needed = Measurement.get(console, console.options.update(max_width=10_000), renderable).maximum
    return Console(width=max(console.width, needed))
