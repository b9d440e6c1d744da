"""The `kvports` command line: parses, then hands the arguments to the subcommand's module.

Imports only NumPy at start; ports load by name inside the commands. Every user error is
one line on stderr, `error: ...`, exit status 2, nothing on stdout, the same whichever
framework was asked for, raised before any port runs.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NoReturn

from kvports import bench
from kvports.commands import batch, chat_command, check, compare, convert, fetch, generate_command, init_weights, serve
from kvports.flags import OutOfRange, resolve_model
from kvports.shared.errors import UserError
from kvports.version import __version__

EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 141  # what a shell reports for a process that SIGPIPE ended: 128 + 13

# Each module has HELP, add_arguments(parser) and run(args) -> exit status.
COMMANDS: dict[str, ModuleType] = {
    "generate": generate_command,
    "chat": chat_command,
    "compare": compare,
    "init-weights": init_weights,
    "convert": convert,
    "bench": bench,
    "batch": batch,
    "serve": serve,
    "check": check,
    "fetch": fetch,
}


class Parser(argparse.ArgumentParser):
    """argparse's parser, except that every parse error is one `error:` line like every other
    user error, where argparse would print its usage first: a value one of our types refuses
    (`--new-tokens 0`) names the flag and the limit; any other points to --help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # `--temperature -inf` or `-1e-3` is a value our type then refuses by name; argparse
        # would take anything but plain negative digits for an unknown flag.
        self._negative_number_matcher = re.compile(r"^-(\.?[0-9]|inf|nan)", re.IGNORECASE)

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = COMMAND_PARSERS.get(getattr(parsed, "command", None) or "", self)
            self.error(f"unrecognized arguments: {' '.join(extras)}{suggestion(extras, command)}")
        return parsed

    def error(self, message: str) -> NoReturn:
        # argparse calls error() while it handles the ArgumentError wrapping the type's exception.
        failure = sys.exc_info()[1]
        if isinstance(failure, argparse.ArgumentError) and isinstance(failure.__context__, OutOfRange):
            raise UserError(f"{failure.argument_name} {failure.message}") from None
        raise UserError(f"{message} (see {self.prog} --help)") from None


COMMAND_PARSERS: dict[str, argparse.ArgumentParser] = {}  # each command's parser, for its flags' names


def suggestion(extras: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """' (did you mean --new-tokens?)' for the first unknown flag near one of the command's."""
    flags = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]
    for extra in extras:
        if extra.startswith("--"):
            close = difflib.get_close_matches(extra.split("=", 1)[0], flags, n=1)
            if close:
                return f" (did you mean {close[0]}?)"
    return ""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser. `only`: the command being run, whose flags alone are built (every
    command is still listed, with its help line, for `kvports --help` and a mistyped name)."""
    parser = Parser(
        prog="kvports", description="Naive vs KV-cached generation of one decoder, in PyTorch, JAX/Flax and NumPy."
    )
    parser.add_argument("--version", action="version", version=f"kvports {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        command = sub.add_parser(name, help=module.HELP)
        if only is None or name == only:
            COMMAND_PARSERS[name] = command
            module.add_arguments(command)
            command.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if not (sys.argv[1:] if argv is None else argv):
        # Bare `kvports`: what it can do, not a line that says only that a command is missing.
        print(build_parser().format_help(), end="", file=sys.stderr)
        return EXIT_USAGE
    try:
        with warnings.catch_warnings():  # NumPy and JAX warn on stderr (an overflow) where torch is silent
            warnings.simplefilter("ignore")
            given = list(sys.argv[1:] if argv is None else argv)
            args = build_parser(only=given[0] if given[0] in COMMANDS else None).parse_args(given)
            resolve_model(args)
            return int(args.run(args))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`kvports compare | head`): stop quietly. stdout is pointed at
        # devnull so that the interpreter's own flush at exit does not fail a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
