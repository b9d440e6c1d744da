"""The install beside a machine's own torch, checked: the README's command for a machine with its own CUDA
torch and JAX must leave that torch as it is (`make check-own-torch`).

A virtualenv gets a stand-in torch first, a wheel made here (the release a CUDA image might ship, with its
local version label), then the README's `pip install` line, offline: every other dependency is already
there (the running interpreter's packages, seen through a .pth file, behind the virtualenv's own), so pip
may only resolve, never download; a torch pin pip would act on makes it install the pinned wheel from the
machine's wheel folder, or fail, and the check fail. Run with the Python of the development venv."""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADING = "### On a machine with its own CUDA torch and JAX"
OWN = "2.6.0+cu124"  # the stand-in's release


def documented_commands(readme: str) -> list[list[str]]:
    """The `pip install` lines of the first sh block under HEADING, each as its arguments after `pip`."""
    section = readme.split(HEADING, 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None, f"no sh block under {HEADING!r}"
    lines = [line.split("#", 1)[0].split() for line in block.group(1).splitlines()]
    commands = [[word.strip("'") for word in line[1:]] for line in lines if line[:2] == ["pip", "install"]]
    assert commands, f"no pip install line under {HEADING!r}"
    return commands


def stand_in_torch(folder: Path) -> Path:
    """A wheel named torch at OWN: its module says its version, nothing else."""
    wheel = folder / f"torch-{OWN}-py3-none-any.whl"
    info = f"torch-{OWN}.dist-info"
    files = {
        "torch/__init__.py": f'__version__ = "{OWN}"\n',
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {OWN}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: kvports\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        archive.writestr(f"{info}/RECORD", "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"]))
    return wheel


def pip(venv_python: Path, *args: str) -> None:
    """The running interpreter's pip, installing into the virtualenv (which has none of its own)."""
    command = [sys.executable, "-m", "pip", "--python", str(venv_python), "--disable-pip-version-check", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"own-torch check failed: pip {' '.join(args)} exited {done.returncode}:\n{done.stderr}")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kvports-own-torch-") as folder:
        check(Path(folder))


def check(folder: Path) -> None:
    venv = folder / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    venv_python = venv / "bin" / "python"
    site = subprocess.run(
        [str(venv_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # The development venv's packages behind the virtualenv's own (its .pth files too: addsitedir).
    parent = sysconfig.get_paths()["purelib"]
    (Path(site) / "zz_parent.pth").write_text(f"import site; site.addsitedir({parent!r})\n")
    pip(venv_python, "install", "--no-index", "--no-deps", str(stand_in_torch(folder)))
    commands = documented_commands((ROOT / "README.md").read_text())
    for args in commands:
        pip(venv_python, *args, "--no-index", "--no-build-isolation")
    probe = "import importlib.metadata as m, torch, kvports; print(m.version('torch'), torch.__version__)"
    seen = subprocess.run([str(venv_python), "-c", probe], capture_output=True, text=True, cwd=folder)
    words = seen.stdout.split()
    if seen.returncode != 0 or words[:2] != [OWN, OWN]:
        sys.exit(f"own-torch check failed: after {commands}, torch is {seen.stdout.strip() or seen.stderr.strip()}")
    if not list(Path(site).glob("kvports-*.dist-info")):
        sys.exit(f"own-torch check failed: {commands} installed no kvports into the virtualenv")
    print(f"ok: pip {' '.join(commands[0])} installed kvports and kept torch {OWN}")


if __name__ == "__main__":
    main()
