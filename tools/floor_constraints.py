"""The oldest releases the ports run on (kvports/registry.py MINIMUM), printed as pip constraints:
`make check-floors` installs exactly these into a virtualenv of their own and runs the port tests there.
It reads registry.py's text, not the module: the Python that runs this has none of kvports' dependencies.
jaxlib needs no line: each jax release pins its own."""

from __future__ import annotations

import ast
from pathlib import Path

REGISTRY = Path(__file__).resolve().parent.parent / "kvports" / "registry.py"


def minimum() -> dict[str, str]:
    """MINIMUM's releases by package: {"torch": "2.6", ...}."""
    for node in ast.parse(REGISTRY.read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(target, "id", None) for target in node.targets] == ["MINIMUM"]:
            return {package: lowest for package, (lowest, _needs) in ast.literal_eval(node.value).items()}
    raise SystemExit(f"{REGISTRY} has no MINIMUM")


def main() -> None:
    for package, lowest in minimum().items():
        print(f"{package}=={lowest}")


if __name__ == "__main__":
    main()
