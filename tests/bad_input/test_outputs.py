"""Output paths kvports refuses: a folder, a missing folder, a name too long, an existing file
without --force, a folder of files kvports did not write, an input it reads (itself, a hard link,
a symbolic link, through a symlinked folder), what is not a regular file. One `error:` line before
any work, nothing written and nothing replaced; a write interrupted leaves the old output whole."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvports.formats.weights import DEFAULT_WEIGHTS, save_weights
from kvports.shared.config import ModelConfig
from tests.helpers.commands import assert_one_error_line, run_cli
from tests.helpers.gguf_files import write_gguf
from tests.helpers.hf_files import hf_dir
from tests.helpers.weights_files import seed_tensors


def dangling_link(tmp_path: Path) -> Path:
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    return tmp_path / "link"


def existing_file(tmp_path: Path) -> Path:
    (tmp_path / "file").write_text("mine")
    return tmp_path / "file"


def folder_with_notes(tmp_path: Path) -> Path:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    return tmp_path / "out"


OUTPUT_CASES = {
    "dangling_symlink_without_force": (
        ["init-weights"],
        dangling_link,
        [],
        "exists; pass --force to overwrite it",
    ),
    "trailing_separator": (["init-weights"], lambda p: f"{p}/newfile/", [], "ends with '/', so it names a folder"),
    "folder_with_force": (["init-weights"], lambda p: p, ["--force"], "is a folder; --out names the file to write"),
    "name_too_long": (["init-weights"], lambda p: p / ("w" * 300), [], "(File name too long)"),
    "name_too_long_for_its_temp_file": (["init-weights"], lambda p: p / ("w" * 250), [], "is too long"),
    "missing_folder": (["init-weights"], lambda p: p / "no" / "w.safetensors", [], "does not exist"),
    "from_hf_over_a_file": (
        ["convert", "--from-hf", "."],
        existing_file,
        [],
        "exists; pass --force",
    ),
    "to_hf_into_a_folder_of_other_files": (
        ["convert", "--to-hf", str(DEFAULT_WEIGHTS)],
        folder_with_notes,
        ["--force"],
        "holds 'notes.txt', which kvports did not write",
    ),
    "to_hf_onto_a_file": (
        ["convert", "--to-hf", str(DEFAULT_WEIGHTS)],
        existing_file,
        [],
        "is a file",
    ),
}


@pytest.mark.parametrize("case", sorted(OUTPUT_CASES))
def test_a_bad_output_path_is_refused_before_any_work(tmp_path, capsys, no_port_may_load, no_tensor_may_be_read, case):
    command, out, extra, expected = OUTPUT_CASES[case]
    target = out(tmp_path)
    before = sorted(os.listdir(tmp_path))
    err = assert_one_error_line(*run_cli(capsys, *command, "--out", target, *extra))
    assert expected in err
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, nothing replaced


# --- whole files and whole folders ----------------------------------------------------------------


@pytest.mark.parametrize("writer", ["write_atomic", "write_folder_atomic"])
def test_sigterm_during_a_write_leaves_no_temp_file(tmp_path, writer):
    """Killed with SIGTERM mid-write, as Ctrl-C would: exit 143, the old output intact, no temp."""
    target = tmp_path / "out"
    if writer == "write_atomic":
        target.write_bytes(b"old")
    else:
        target.mkdir()
        (target / "config.json").write_bytes(b"old")
    script = f"""
import os, signal
from kvports.shared import files
def killed(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
files.write_synced = killed
payload = {{"config.json": b"new"}} if {writer!r} == "write_folder_atomic" else b"new"
files.{writer}({str(target)!r}, payload)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert result.returncode == 143, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert (target if writer == "write_atomic" else target / "config.json").read_bytes() == b"old"


def test_to_hf_replaces_the_whole_folder_or_nothing(tmp_path, capsys, monkeypatch):
    """Killed between the two files, --to-hf --force leaves the old model whole: never new
    weights beside an old config."""
    from kvports.shared import files

    out = tmp_path / "gpt2"
    assert run_cli(capsys, "convert", "--to-hf", DEFAULT_WEIGHTS, "--out", out)[0] == 0
    old = {name: (out / name).read_bytes() for name in ("config.json", "model.safetensors")}
    other = tmp_path / "other.safetensors"
    save_weights(other, {k: v * 2 for k, v in seed_tensors().items()}, ModelConfig())
    written = []
    real = files.write_synced

    def interrupted_at_the_second_file(path, payload, fd=None):
        written.append(path)
        if len(written) == 2:
            raise KeyboardInterrupt
        real(path, payload, fd)

    monkeypatch.setattr(files, "write_synced", interrupted_at_the_second_file)
    code, _, err = run_cli(capsys, "convert", "--to-hf", other, "--out", out, "--force")
    assert (code, err) == (130, "error: interrupted\n")
    assert {name: (out / name).read_bytes() for name in old} == old
    assert sorted(os.listdir(tmp_path)) == ["gpt2", "other.safetensors"]


# --- never over an input, never what is not a regular file ----------------------------------------


@pytest.fixture
def llama(tmp_path) -> Path:
    return hf_dir(tmp_path)


def assert_unchanged(paths: list[Path], before: dict[Path, bytes]) -> None:
    assert {path: path.read_bytes() for path in paths} == before


@pytest.mark.parametrize("alias", ["itself", "hard_link", "symlink", "through_a_symlinked_folder"])
def test_convert_force_never_writes_over_its_input_shard(tmp_path, capsys, llama, alias):
    shard = llama / "model.safetensors"
    before = {shard: shard.read_bytes()}
    if alias == "itself":
        out = shard
    elif alias == "hard_link":
        out = tmp_path / "hard.safetensors"
        os.link(shard, out)
    elif alias == "symlink":
        out = tmp_path / "soft.safetensors"
        out.symlink_to(shard)
    else:
        (tmp_path / "folder").symlink_to(llama)
        out = tmp_path / "folder" / "model.safetensors"
    err = assert_one_error_line(*run_cli(capsys, "convert", "--from-hf", llama, "--out", out, "--force"))
    assert "an input kvports reads: it never writes over its input" in err, err
    assert_unchanged([shard], before)


def test_convert_force_never_writes_over_the_config_it_reads(tmp_path, capsys, llama):
    before = {llama / "config.json": (llama / "config.json").read_bytes()}
    err = assert_one_error_line(
        *run_cli(capsys, "convert", "--from-hf", llama, "--out", llama / "config.json", "--force")
    )
    assert f"'{llama / 'config.json'}' is an input kvports reads" in err
    assert_unchanged(list(before), before)


@pytest.mark.parametrize("alias", ["inside", "hard_link"])
def test_to_hf_force_never_replaces_a_folder_that_holds_its_input(tmp_path, capsys, alias):
    folder = tmp_path / "model"
    folder.mkdir()
    inside = folder / "model.safetensors"
    inside.write_bytes(DEFAULT_WEIGHTS.read_bytes())
    source = inside
    if alias == "hard_link":
        source = tmp_path / "weights.safetensors"
        os.link(inside, source)
    err = assert_one_error_line(*run_cli(capsys, "convert", "--to-hf", source, "--out", folder, "--force"))
    assert f"'{folder}' holds '{inside}'," in err and "an input kvports reads" in err, err
    assert sorted(os.listdir(folder)) == ["model.safetensors"]
    assert inside.read_bytes() == DEFAULT_WEIGHTS.read_bytes()


def test_init_weights_force_never_writes_over_the_shipped_seed_model(tmp_path, capsys, monkeypatch):
    """The shipped seed model is every command's default --weights (a copy stands in for it here)."""
    seed = tmp_path / "seed_model.safetensors"
    seed.write_bytes(DEFAULT_WEIGHTS.read_bytes())
    monkeypatch.setattr("kvports.commands.init_weights.DEFAULT_WEIGHTS", seed)
    link = tmp_path / "link.safetensors"
    os.link(seed, link)
    for out in (seed, link):
        err = assert_one_error_line(*run_cli(capsys, "init-weights", "--out", out, "--force", "--init", "numpy"))
        assert "an input kvports reads" in err, err
    assert seed.read_bytes() == DEFAULT_WEIGHTS.read_bytes()


def fifo(tmp_path: Path) -> Path:
    os.mkfifo(tmp_path / "fifo")
    return tmp_path / "fifo"


def symlink_to_a_file(tmp_path: Path) -> Path:
    (tmp_path / "mine.txt").write_text("mine")
    (tmp_path / "link").symlink_to(tmp_path / "mine.txt")
    return tmp_path / "link"


NOT_REGULAR = {
    "fifo": (fifo, "is not a regular file; kvports replaces only a regular file"),
    "symlink_to_a_file": (symlink_to_a_file, "is a symbolic link; kvports replaces only a regular file"),
    "dangling_symlink": (dangling_link, "is a symbolic link; kvports replaces only a regular file"),
}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("writer", ["init-weights", "convert --from-hf"])
@pytest.mark.parametrize("case", sorted(NOT_REGULAR))
def test_force_never_replaces_what_is_not_a_regular_file(tmp_path, capsys, case, writer):
    make, expected = NOT_REGULAR[case]
    target = make(tmp_path)
    command = (
        ["init-weights", "--init", "numpy"] if writer == "init-weights" else ["convert", "--from-hf", hf_dir(tmp_path)]
    )
    kinds = {name: os.lstat(tmp_path / name).st_mode for name in os.listdir(tmp_path)}
    err = assert_one_error_line(*run_cli(capsys, *command, "--out", target, "--force"))
    assert expected in err, err
    assert {name: os.lstat(tmp_path / name).st_mode for name in os.listdir(tmp_path)} == kinds


def test_to_hf_never_replaces_a_symlink_or_a_folder_whose_files_kvports_did_not_write(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "link").symlink_to(empty)
    err = assert_one_error_line(*run_cli(capsys, "convert", "--to-hf", DEFAULT_WEIGHTS, "--out", tmp_path / "link"))
    assert "'link' is a symbolic link; --out names the directory to write" in err.replace(str(tmp_path) + "/", "")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").symlink_to(tmp_path / "elsewhere.json")
    err = assert_one_error_line(*run_cli(capsys, "convert", "--to-hf", DEFAULT_WEIGHTS, "--out", folder, "--force"))
    assert "config.json' is a symbolic link; kvports did not write it" in err, err
    assert (folder / "config.json").is_symlink() and (tmp_path / "link").is_symlink()


@pytest.mark.parametrize("alias", ["itself", "hard_link"])
def test_convert_from_gguf_force_never_writes_over_its_input(tmp_path, capsys, alias):
    source = write_gguf(tmp_path / "m.gguf")
    before = {source: source.read_bytes()}
    out = source if alias == "itself" else tmp_path / "hard.gguf"
    if alias == "hard_link":
        os.link(source, out)
    err = assert_one_error_line(*run_cli(capsys, "convert", "--from-gguf", source, "--out", out, "--force"))
    assert "an input kvports reads: it never writes over its input" in err, err
    assert_unchanged([source], before)
