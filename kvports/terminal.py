"""Printing a wide table whole: rich would squeeze (and cut) columns to fit a narrow terminal,
or the 80 columns it assumes for a pipe."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console, RenderableType


def stdout_console(width: int | None = None) -> Console:
    """A stdout console that lets a closed pipe (`kvports compare | head -1`) end the command as
    every command ends then (kvports.cli's BrokenPipeError): rich's own handler exits with status 1."""
    from rich.console import Console

    class PipeConsole(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError

    return PipeConsole(width=width)


def console_for(renderable: RenderableType) -> Console:
    """A stdout console at least as wide as the renderable needs (the terminal's width if wider)."""
    from rich.measure import Measurement

    console = stdout_console()
    needed = Measurement.get(console, console.options.update(max_width=10_000), renderable).maximum
    return stdout_console(width=max(console.width, needed))
