"""`kvports serve` whose every engine step takes at least SECONDS (`tests.helpers.servers.SlowPort`), as a
process of its own: `python -m tests.helpers.slow_serve SECONDS serve ARGV...`. Its requests run long
enough for a test to signal the process while they do."""

from __future__ import annotations

import sys

from kvports.cli import main
from kvports.commands import serve
from tests.helpers.servers import SlowPort


def run(argv: list[str]) -> int:
    seconds, prepare = float(argv[0]), serve.prepare
    serve.prepare = lambda args, wrap_port=None: prepare(args, lambda port: SlowPort(port, seconds))  # type: ignore[assignment]
    return main(argv[1:])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
