"""The child process isolate.py starts: `python -m kvports.checker.child FD TARGET FAMILY QUICK`
runs the checks and sends each event (isolate.py lists them) to its parent over the pipe FD."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from kvports.checker.plugin import listening
from kvports.checker.suite import run_check
from kvports.shared.errors import UserError


def child_main(argv: list[str]) -> int:
    fd, target, family, quick = int(argv[0]), argv[1], argv[2], argv[3] == "1"
    channel = os.fdopen(fd, "w")

    def send(event: dict[str, Any]) -> None:
        channel.write(json.dumps(event) + "\n")
        channel.flush()

    with listening(send):
        try:
            report = run_check(target, family, quick)
        except UserError as error:
            send({"event": "user_error", "message": str(error)})
            return 0
    send({"event": "report", "report": report.as_dict()})
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
