"""Regenerate (or check) every command output pasted into the README and docs/, from the
command it shows.

A pasted output is a fenced block right after a marker naming its command:

    <!-- output of: kvports generate --framework numpy --mode cached | tail -3 -->
    ```text
    ...what the command printed...
    ```

The command runs in bash from the repository root (a pipe to `tail` or `head` is part of it),
with this Python's `kvports` first on PATH and a fixed terminal width, and its stdout and
stderr, together, become the block. `python (the block above)` runs the ```python block just
above the marker, as pasting it into `python -` would. Options in parentheses before the colon, comma-separated:
`needs smollm2` marks a command that reads the real model (skipped, with a note, until
`kvports fetch smollm2` has run); `numbers vary` masks every number in the check, for a float32
table whose last digits (and where its noise peaks) follow the machine's thread count: the check
then holds the words, the statuses and the shape.

    python tools/pasted_outputs.py            # rewrite every block from its command
    python tools/pasted_outputs.py --check    # exit 1 naming each block whose command now prints otherwise
    python tools/pasted_outputs.py --list     # the markers, file by file

Timings differ from run to run, so the check compares outputs with every duration, rate and
speed-up masked (`normalize`) and runs of spaces or rule characters collapsed (a table's
columns widen with their numbers).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- output of(?: \((?P<options>[^)]*)\))?: (?P<command>.+?) -->\n```[a-z]*\n", re.M)
OPTIONS = ("needs smollm2", "numbers vary")
WIDTH = 100  # the terminal width the pasted tables were printed at
TIMEOUT = 900  # seconds a command may take (JAX compiling a 30-layer model on a busy machine)
# What changes between runs: seconds, milliseconds, tokens per second, speed-ups ("2.9x"), load averages.
VOLATILE = [
    r"\d+(?:\.\d+)?(?:e[-+]?\d+)? ?(?:ms|s|tokens/s|x)\b",
    r"load average [\d., ]+",
]
NUMBER = r"\d+(?:\.\d+)?(?:e[-+]?\d+)?"  # what `numbers vary` masks beside the timings


ABOVE = "python (the block above)"  # the command that runs the nearest ```python block before its marker


@dataclass(frozen=True)
class Pasted:
    document: Path
    marker: str  # the command as the marker writes it
    command: str  # what runs
    options: tuple[str, ...]
    start: int  # the block's text: document[start:end]
    end: int

    @property
    def name(self) -> str:
        return f"{self.document.name}: {self.marker}"


def find(document: Path) -> list[Pasted]:
    text = document.read_text()
    found = []
    for match in MARKER.finditer(text):
        end = text.find("```", match.end())
        if end < 0:
            raise SystemExit(f"{document.name}: the block after `{match['command']}` is not closed")
        options = tuple(option.strip() for option in (match["options"] or "").split(",") if option.strip())
        unknown = [option for option in options if option not in OPTIONS]
        if unknown:
            raise SystemExit(
                f"{document.name}: unknown option {unknown[0]!r} for `{match['command']}`; known: {OPTIONS}"
            )
        command = match["command"]
        if command == ABOVE:
            blocks = re.findall(r"^```python\n(.*?)^```", text[: match.start()], re.M | re.S)
            if not blocks:
                raise SystemExit(f"{document.name}: `{ABOVE}` has no ```python block above it")
            command = "python - <<'KVPORTS_EXAMPLE'\n" + blocks[-1] + "KVPORTS_EXAMPLE"
        found.append(Pasted(document, match["command"], command, options, match.end(), end))
    return found


def every_pasted() -> list[Pasted]:
    return [pasted for document in DOCUMENTS for pasted in find(document)]


def missing(pasted: Pasted) -> str | None:
    """Why this block's command cannot run here, or None."""
    if "needs smollm2" in pasted.options:
        home = Path(os.environ.get("KVPORTS_HOME", Path.home() / ".cache" / "kvports"))
        if not (home / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file():
            return "the real model is not fetched (kvports fetch smollm2)"
    return None


def run(command: str) -> str:
    """What `command` prints (stdout and stderr as one stream), as a user at a WIDTH-column terminal sees it."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "COLUMNS": str(WIDTH)}
    env.pop("FORCE_COLOR", None)
    env["NO_COLOR"] = "1"
    env["PYTHONUNBUFFERED"] = "1"  # stdout and stderr interleaved as a terminal shows them
    result = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT,
    )
    output = "\n".join(line.rstrip() for line in result.stdout.splitlines())
    return output + "\n"


def normalize(output: str, numbers_vary: bool = False) -> str:
    """The output with what differs between runs masked: timings (every decimal number, where
    they vary), and the widths they give a table."""
    for pattern in VOLATILE + ([NUMBER] if numbers_vary else []):
        output = re.sub(pattern, "<t>", output)
    output = re.sub(r"─+", "─", output)
    return "\n".join(" ".join(line.split()) for line in output.splitlines()).strip()


def stale(pasted: Pasted) -> str | None:
    """A one-line reason the pasted block no longer matches its command's output, or None."""
    vary = "numbers vary" in pasted.options
    printed = normalize(run(pasted.command), vary).splitlines()
    shown = normalize(pasted.document.read_text()[pasted.start : pasted.end], vary).splitlines()
    if printed == shown:
        return None
    for number, (old, new) in enumerate(zip(shown, printed, strict=False)):
        if old != new:
            return f"{pasted.name}: line {number + 1} is now {new!r} (pasted: {old!r})"
    return f"{pasted.name}: {len(printed)} lines now, {len(shown)} pasted"


def rewrite(document: Path) -> list[str]:
    """Every block of `document` replaced by what its command prints now; the commands skipped, with why."""
    skipped = []
    for pasted in reversed(find(document)):  # from the end: earlier offsets stay valid
        reason = missing(pasted)
        if reason is not None:
            skipped.append(f"{pasted.name}: skipped, {reason}")
            continue
        text = document.read_text()
        document.write_text(text[: pasted.start] + run(pasted.command) + text[pasted.end :])
    return skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="exit 1 naming each block whose command prints otherwise")
    parser.add_argument("--list", action="store_true", help="the markers, file by file")
    args = parser.parse_args(argv)
    if args.list:
        for pasted in every_pasted():
            print(pasted.name + (f"  ({', '.join(pasted.options)})" if pasted.options else ""))
        return 0
    if args.check:
        problems = [
            problem for pasted in every_pasted() if not missing(pasted) for problem in [stale(pasted)] if problem
        ]
        for problem in problems:
            print(problem)
        return 1 if problems else 0
    for document in DOCUMENTS:
        for note in rewrite(document):
            print(note, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
