"""Print a function, class or method of the three ports' lessons (model.py, sampling.py, generate.py)
side by side, as a Markdown table with one source line per row (comments and docstrings dropped).

    python tools/side_by_side.py                   # Block.attention: the README's table, which a test keeps current
    python tools/side_by_side.py KVCache.update    # a method
    python tools/side_by_side.py token_positions   # a function
    python tools/side_by_side.py KVCache           # a whole class
    python tools/side_by_side.py decode_one_token  # generate.py's loop step
    python tools/side_by_side.py --list            # every name the three ports' lessons share

Where the ports' line counts differ, lines are aligned against the reference (torch):
identical lines share a row, differing lines share one where they are alike (difflib's
similarity), and a line one port has alone gets a row of its own.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PORTS = ("torch_impl", "jax_impl", "numpy_impl")
FILES = ("model.py", "sampling.py", "generate.py")  # the files every port mirrors, in reading order
DEFAULT = "Block.attention"
Definition = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def parse(port: str, file: str = "model.py") -> tuple[ast.Module, list[str]]:
    source = (ROOT / port / file).read_text()
    return ast.parse(source), source.splitlines()


def locate(port: str, name: str) -> tuple[str, ast.AST, list[str]]:
    """The file of `port` that defines `name`, its definition's node and the file's lines."""
    for file in FILES:
        tree, lines = parse(port, file)
        node = find(tree, name)
        if node is not None:
            return file, node, lines
    raise LookupError(f"{name} is not defined in {port}/{', '.join(FILES[:-1])} or {FILES[-1]}")


def find(tree: ast.Module, name: str) -> ast.AST | None:
    """`Block.attention` -> the method's node; `token_positions` -> the function's."""
    body: list[ast.stmt] = tree.body
    node = None
    for part in name.split("."):
        node = next((n for n in body if isinstance(n, Definition) and n.name == part), None)
        if node is None:
            return None
        body = node.body
    return node


def names(tree: ast.Module) -> list[str]:
    """Top-level functions and classes, and each class's methods as `Class.method`, in file order."""
    found = []
    for node in tree.body:
        if isinstance(node, Definition):
            found.append(node.name)
            if isinstance(node, ast.ClassDef):
                found += [f"{node.name}.{n.name}" for n in node.body if isinstance(n, Definition)]
    return found


def port_names(port: str) -> list[str]:
    """names() of each of the port's FILES, in reading order."""
    return [name for file in FILES for name in names(parse(port, file)[0])]


def shared_names() -> list[str]:
    common = set.intersection(*(set(port_names(port)) for port in PORTS))
    return [name for name in port_names(PORTS[0]) if name in common]


def docstring_lines(node: ast.AST) -> set[int]:
    """1-based line numbers of every docstring inside node (its own and its methods')."""
    lines: set[int] = set()
    for inner in ast.walk(node):
        if isinstance(inner, Definition) and inner.body:
            first = inner.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def source_lines(port: str, name: str) -> list[str]:
    """The definition's code lines (decorators included; comment-only lines and docstrings
    dropped), dedented to its own indentation."""
    _, node, lines = locate(port, name)
    assert isinstance(node, Definition)
    first = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])
    skipped = docstring_lines(node)
    return [
        lines[number - 1][node.col_offset :]
        for number in range(first, (node.end_lineno or node.lineno) + 1)
        if number not in skipped and not lines[number - 1].strip().startswith("#")
    ]


SIMILAR = 0.5  # two differing lines share a row only if difflib finds them at least this alike


def align(reference: list[str], other: list[str]) -> list[tuple[int | None, int | None]]:
    """(reference index, other index) pairs in order; None where one side has no line. Identical
    runs pair up; within a run that differs, lines pair by similarity (the best-scoring order-keeping
    matching), and the rest stand alone."""
    pairs: list[tuple[int | None, int | None]] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, reference, other, autojunk=False).get_opcodes():
        if tag == "equal":
            pairs += [(i1 + k, j1 + k) for k in range(i2 - i1)]
        else:
            pairs += match_similar(reference, other, range(i1, i2), range(j1, j2))
    return pairs


def match_similar(
    reference: list[str], other: list[str], left: range, right: range
) -> list[tuple[int | None, int | None]]:
    """Needleman-Wunsch over one differing run: score = the sum of the paired lines' similarity."""
    n, m = len(left), len(right)
    ratio = [
        [difflib.SequenceMatcher(None, reference[i].strip(), other[j].strip()).ratio() for j in right] for i in left
    ]
    best = [[0.0] * (m + 1) for _ in range(n + 1)]
    for a in range(n - 1, -1, -1):
        for b in range(m - 1, -1, -1):
            paired = best[a + 1][b + 1] + ratio[a][b] if ratio[a][b] >= SIMILAR else -1.0
            best[a][b] = max(paired, best[a + 1][b], best[a][b + 1])
    pairs: list[tuple[int | None, int | None]] = []
    a = b = 0
    while a < n or b < m:
        if a < n and b < m and ratio[a][b] >= SIMILAR and best[a][b] == best[a + 1][b + 1] + ratio[a][b]:
            pairs.append((left[a], right[b]))
            a, b = a + 1, b + 1
        elif a < n and (b == m or best[a][b] == best[a + 1][b]):
            pairs.append((left[a], None))
            a += 1
        else:
            pairs.append((None, right[b]))
            b += 1
    return pairs


def rows(columns: list[list[str]]) -> list[list[str]]:
    """One row per source line: zipped when the line counts agree, else aligned against the first column."""
    if len({len(column) for column in columns}) == 1:
        return [list(row) for row in zip(*columns, strict=True)]
    reference = columns[0]
    # For each other column: the lines it has alone before reference line i, and its line beside line i.
    before: list[list[list[str]]] = []
    beside: list[list[str]] = []
    for column in columns[1:]:
        alone: list[list[str]] = [[] for _ in range(len(reference) + 1)]
        paired = [""] * len(reference)
        position = 0
        for i, j in align(reference, column):
            if i is None:
                alone[position].append(column[j] if j is not None else "")
            else:
                paired[i] = column[j] if j is not None else ""
                position = i + 1
        before.append(alone)
        beside.append(paired)
    table = []
    for i in range(len(reference) + 1):
        for extra in range(max(len(alone[i]) for alone in before)):
            table.append([""] + [alone[i][extra] if extra < len(alone[i]) else "" for alone in before])
        if i < len(reference):
            table.append([reference[i]] + [paired[i] for paired in beside])
    return table


def table(name: str = DEFAULT) -> str:
    def cell(line: str) -> str:
        return "`" + line.replace("|", "\\|") + "`" if line.strip() else ""

    lines = ["| " + " | ".join(f"`{port}/{locate(port, name)[0]}`" for port in PORTS) + " |", "|---|---|---|"]
    lines += [
        "| " + " | ".join(cell(line) for line in row) + " |" for row in rows([source_lines(p, name) for p in PORTS])
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/side_by_side.py",
        description="Print a function, class or method of the three ports' model.py, sampling.py or generate.py "
        "side by side (a Markdown table, one source line per row, comments and docstrings dropped).",
    )
    parser.add_argument(
        "name",
        nargs="?",
        default=DEFAULT,
        help=f"a function (token_positions), class (KVCache) or method (KVCache.update) (default {DEFAULT})",
    )
    parser.add_argument("--list", action="store_true", help="list every name the three ports' lessons share")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(shared_names()))
        return 0
    try:
        print(table(args.name))
    except LookupError as exc:
        parser.error(f"{exc}; --list shows the names all three share")
    return 0


if __name__ == "__main__":
    sys.exit(main())
