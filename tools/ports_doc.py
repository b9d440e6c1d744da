"""Render docs/PORTS.md's port.py tables from kvports.shared.contract (the Protocols).
`python tools/ports_doc.py` rewrites that section in place; a test keeps it in sync."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, kvports importable or not

from kvports.shared import contract  # noqa: E402

PORTS_MD = ROOT / "docs" / "PORTS.md"
BEGIN = "<!-- generated from kvports.shared.contract by tools/ports_doc.py: edit the Protocols, then run it -->"
END = "<!-- end of generated section -->"


def attribute_comments() -> dict:
    """`NAME: str  # what it is` in contract.py -> {"NAME": "what it is"}: attributes have no docstrings."""
    source = Path(contract.__file__).read_text()
    return dict(re.findall(r"^    ([A-Z_]+): [^#\n]+#\s*(.+)$", source, flags=re.M))


def call(name: str, signature: inspect.Signature) -> str:
    bare = [param.replace(annotation=inspect.Parameter.empty) for param in signature.parameters.values()]
    return f"`{name}{signature.replace(parameters=bare, return_annotation=inspect.Signature.empty)}`"


def table(protocol: type) -> str:
    comments = attribute_comments()
    rows = ["| name | what |", "|---|---|"]
    for name, signature in contract.members(protocol).items():
        if signature is None:
            rows.append(f"| `{name}` | {comments.get(name, '')} |")
        else:
            doc = " ".join(inspect.getdoc(getattr(protocol, name)).split()).replace("|", "\\|")
            rows.append(f"| {call(name, signature)} | {doc} |")
    return "\n".join(rows)


def section() -> str:
    return "\n\n".join(
        [
            BEGIN,
            f"### `Port`: every `port.py`\n{' '.join(inspect.getdoc(contract.Port).split())}",
            table(contract.Port),
            "### `Baseline`: every baseline in `kvports/baselines/`\n"
            + " ".join(inspect.getdoc(contract.Baseline).split()),
            table(contract.Baseline),
            END,
        ]
    )


def rewritten(text: str) -> str:
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + section() + text[end:]


if __name__ == "__main__":
    PORTS_MD.write_text(rewritten(PORTS_MD.read_text()))
    print(f"wrote {PORTS_MD}")
