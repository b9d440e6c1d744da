"""Print the three ports' attention code as a Markdown table, one source line per row,
for the README. `python tools/side_by_side.py` regenerates it; a test keeps it in sync."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PORTS = ("torch_impl", "jax_impl", "numpy_impl")


def attention_lines(port: str) -> list:
    """The code lines of Block.attention (comment-only lines dropped), dedented."""
    lines = (ROOT / port / "model.py").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("    def attention("))
    end = next(i for i in range(start, len(lines)) if "return self.proj(" in lines[i])
    return [line[4:] for line in lines[start : end + 1] if not line.strip().startswith("#")]


def table() -> str:
    columns = [attention_lines(port) for port in PORTS]
    if len({len(column) for column in columns}) != 1:
        raise SystemExit(f"the ports' attention code no longer lines up: {[len(c) for c in columns]} lines")

    def cell(line: str) -> str:
        return "`" + line.replace("|", "\\|") + "`" if line.strip() else ""

    rows = ["| " + " | ".join(f"`{port}/model.py`" for port in PORTS) + " |", "|---|---|---|"]
    rows += ["| " + " | ".join(cell(line) for line in row) + " |" for row in zip(*columns, strict=True)]
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
