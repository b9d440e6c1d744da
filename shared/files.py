"""Writing files and folders so that a crash never leaves a half-written one behind, and an
interruption (Ctrl-C or SIGTERM) leaves no temp file; and the checks on an output path
that run before any work is done for it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvports.shared.errors import UserError, echo, echo_path

TEMP_SUFFIX = ".XXXXXXXX.tmp"  # what mkstemp adds to a name, by length: `.NAME` + 8 random characters + `.tmp`


@contextlib.contextmanager
def terminated_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit(143) inside the block, so the cleanup that runs for Ctrl-C
    (an exception) runs for it too; its default action would end the process on the spot,
    temp file and all. Only the main thread may set a handler: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def usual_mode(path: str, mode: int) -> None:
    """mkstemp and mkdtemp make 0600 and 0700: give the umask's usual mode instead."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, mode & ~umask)


def write_synced(path: str | Path, payload: bytes, fd: int | None = None) -> None:
    with os.fdopen(fd, "wb") if fd is not None else open(path, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())


def write_atomic(path: os.PathLike, payload: bytes) -> None:
    """A temp file in the target's folder, flushed to disk, then renamed over the target:
    readers see the old file or the new one, never a torn one."""
    with temp_beside(Path(path)) as tmp:
        write_synced(tmp, payload)


@contextlib.contextmanager
def temp_beside(path: Path) -> Iterator[str]:
    """A temp file's name in the target's folder, for the block to write (a library's writer, say);
    renamed over the target when the block ends, removed when it raises or is interrupted."""
    with terminated_as_exit(), os_errors_as_user_errors(path):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        try:
            yield tmp
            usual_mode(tmp, 0o666)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise


def write_folder_atomic(path: os.PathLike, files: dict[str, bytes]) -> None:
    """A temp folder beside the target, every file in it flushed, then renamed into place:
    readers see the old folder or the new one, never new weights beside an old config. A
    folder already there is renamed aside first and removed after (POSIX renames a folder
    only over an empty one): a crash between the two renames leaves it whole under a temp
    name beside the target, never mixed with the new one."""
    path = Path(path)
    with terminated_as_exit(), os_errors_as_user_errors(path):
        tmp = tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        aside = None
        try:
            for name, payload in files.items():
                write_synced(Path(tmp) / name, payload)
            usual_mode(tmp, 0o777)
            if os.path.lexists(path):
                aside = tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old")
                os.replace(path, aside)
            os.replace(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if aside is not None and not os.path.lexists(path):
                os.replace(aside, path)  # the old folder back where it was
                aside = None
            raise
        finally:
            if aside is not None:
                shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def os_errors_as_user_errors(path: Path) -> Iterator[None]:
    """A path the user named that cannot be written (no permission, a full disk, a name too
    long) is one `error:` line naming it, not a traceback."""
    try:
        yield
    except OSError as exc:
        raise UserError(f"cannot write {echo_path(path)} ({exc.strerror or exc})") from None


def check_writable_folder(folder: Path, name: str) -> None:
    """The folder exists and takes a new entry `name` and its temp twin."""
    if not folder.is_dir():
        raise UserError(f"folder {echo_path(folder)} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"folder {echo_path(folder)} is not writable")
    try:
        limit = os.pathconf(folder, "PC_NAME_MAX")
    except (AttributeError, ValueError, OSError):  # no pathconf here (Windows): the write will tell
        return
    if len(os.fsencode(name)) + len(TEMP_SUFFIX) + 1 > limit:
        raise UserError(
            f"name {echo(name)} is too long: this folder takes names of at most {limit - len(TEMP_SUFFIX) - 1} "
            "bytes for an output (its temp file adds the rest)"
        )


def check_output_file(path: Path, force: bool, inputs: Sequence[Path] = ()) -> None:
    """Before any work is done for it: an output file's path can be written, and an existing
    one (a dangling symlink too) is replaced only with --force, only if it is a regular file,
    and never if it is one of the command's `inputs` (a file, or a folder and so each file in
    it), whatever the path it is reached by (a symlink, a hard link)."""
    with os_errors_as_user_errors(path):
        if path.is_dir():
            raise UserError(f"{echo_path(path)} is a folder; --out names the file to write")
        check_not_an_input(path, inputs)
        if os.path.lexists(path):
            if not force:
                raise UserError(f"{echo_path(path)} exists; pass --force to overwrite it")
            check_regular(path, "kvports replaces only a regular file")
        check_writable_folder(path.parent, path.name)


OURS = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")  # what `convert --to-hf` writes


def check_output_folder(path: Path, force: bool, inputs: Sequence[Path] = ()) -> None:
    """Before any work: the folder `convert --to-hf` will replace whole. An empty one is taken;
    one holding a model only with --force; one holding anything else, a symlink, or any of the
    command's `inputs` never (it would go)."""
    with os_errors_as_user_errors(path):
        if os.path.lexists(path) and (path.is_symlink() or not path.is_dir()):
            kind = "a symbolic link" if path.is_symlink() else "a file"
            raise UserError(f"{echo_path(path)} is {kind}; --out names the directory to write")
        if path.is_dir():
            others = sorted(set(os.listdir(path)) - set(OURS))
            if others:
                more = f" and {len(others) - 1} more" if len(others) > 1 else ""
                raise UserError(
                    f"{echo_path(path)} holds {echo(others[0])}{more}, which kvports did not write: the whole "
                    "directory is replaced, so give a new or empty one"
                )
            for name in sorted(os.listdir(path)):
                check_not_an_input(path / name, inputs, holder=path)
                check_regular(path / name, "kvports did not write it, and the whole directory is replaced")
            if os.listdir(path) and not force:
                raise UserError(f"{echo_path(path)} already holds a model; pass --force to overwrite it")
        check_writable_folder(path.parent, path.name)


def check_regular(path: Path, why: str) -> None:
    """An existing output is replaced only if it is a regular file: a symlink would be replaced
    by a file in its place, a device or a FIFO by a file of that name."""
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = "a symbolic link" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode) else "not a regular file"
        raise UserError(f"{echo_path(path)} is {kind}; {why}")


def check_not_an_input(path: Path, inputs: Sequence[Path], holder: Path | None = None) -> None:
    """`path` (if it exists) is none of `inputs` and no file of an input folder: compared as
    files (os.path.samefile), so a symlink or a hard link to an input is caught too. holder:
    the folder being replaced that holds `path`, for the message."""
    try:
        target = os.stat(path)
    except OSError:  # nothing there (or a dangling symlink): nothing to destroy
        return
    for source in inputs:
        try:
            candidates = [source, *sorted(source.iterdir())] if source.is_dir() else [source]
        except OSError:  # an input that cannot be read is refused when it is read
            continue
        for candidate in candidates:
            with contextlib.suppress(OSError):
                if os.path.samestat(target, os.stat(candidate)):
                    alias = "" if candidate == path else f" the same file as {echo_path(candidate)},"
                    where = (
                        f"{echo_path(path)} is" if holder is None else f"{echo_path(holder)} holds {echo_path(path)},"
                    )
                    raise UserError(f"{where}{alias} an input kvports reads: it never writes over its input")
