"""Bad input, bounded: numbers that would overflow (a temperature too small to divide by, a
config float past where the ports agree), files read whole whatever their size, request
files split where JSON does not, and outputs that would destroy an input or something that
is not a regular file. Each is one `error:` line naming the value and the limit, exit 2,
the same in every port, with nothing lost."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kvports.batching.requests import parse_requests, split_lines
from kvports.formats.weights import DEFAULT_WEIGHTS, gpt2_init_weights, save_weights
from kvports.shared.checks import MIN_TEMPERATURE
from kvports.shared.config import ModelConfig
from kvports.shared.generation import GenerationConfig
from tests.helpers.commands import assert_one_error_line, run_cli
from tests.helpers.hf_files import llama_config, llama_tensors, write_hf_dir
from tests.helpers.models import TINY_FAMILIES

MiB = 2**20
TEMPERATURE_RULE = "must be a finite number >= 0 (0 means greedy; else in [1e-12, 1e+18]"


def generate(capsys, port, *argv) -> str:
    """`kvports generate` in this port, refused: its one error line."""
    return assert_one_error_line(*run_cli(capsys, "generate", "--framework", port.NAME, "--mode", "cached", *argv))


def requests_file(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def batch(capsys, port, *argv) -> tuple[int, str, str]:
    return run_cli(capsys, "batch", "--framework", port.NAME, *argv)


def sparse(path: Path, size: int) -> Path:
    """A file of `size` zero bytes that takes no disk."""
    with open(path, "wb") as handle:
        handle.truncate(size)
    return path


def hf_dir(tmp_path: Path, **config_changes) -> Path:
    """The small Llama of tests.helpers.hf_files, its config.json changed."""
    return write_hf_dir(tmp_path / "llama", llama_config(**config_changes), llama_tensors(llama_config()))


# --- numbers that overflow ------------------------------------------------------------


@pytest.mark.parametrize("temperature", ["1e-320", "1e-300", "1e-20", "9e-13"])
def test_a_temperature_too_small_for_exact_logits_is_refused(capsys, port, temperature):
    """Below 1.9e-270 logits / T is inf in float64 and every port drew token 0 forever; at 1e-20
    the seed's logits / T are past 2**53, and JAX alone drew token 0."""
    err = generate(capsys, port, "--temperature", temperature)
    assert err.startswith(f"error: temperature {float(temperature)!r} {TEMPERATURE_RULE}"), err


@pytest.mark.parametrize("temperature", ["-inf", "-1e-3", "-Infinity"])
def test_a_negative_temperature_is_named_not_taken_for_a_flag(capsys, port, temperature):
    err = generate(capsys, port, "--temperature", temperature)
    assert err.startswith(f"error: temperature {float(temperature)!r} {TEMPERATURE_RULE}"), err


def test_a_temperature_with_an_underscore_is_refused_as_the_integer_flags_refuse_it(capsys, port):
    assert generate(capsys, port, "--temperature", "1_0").startswith(
        "error: argument --temperature: invalid number: '1_0'"
    )
    assert generate(capsys, port, "--new-tokens", "1_0").startswith("error: argument --new-tokens: invalid int value")


def test_the_smallest_temperature_samples_the_greedy_tokens_in_every_port(port, seed_weights):
    """At the bound logits / T stay exact enough for JAX's softmax too: every port draws the argmax."""
    config, tensors = seed_weights
    model = port.load_model(config, tensors)
    prompts = np.array([[160, 248, 104, 209, 394]])
    greedy, _ = port.generate(model, prompts, 8, "cached")
    coldest = GenerationConfig(8, temperature=MIN_TEMPERATURE, seed=3).validate(config.vocab_size)
    sampled, _ = port.generate(model, prompts, coldest, "cached")
    np.testing.assert_array_equal(sampled, greedy)
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        GenerationConfig(8, temperature=float(np.nextafter(MIN_TEMPERATURE, 0))).validate(config.vocab_size)


@pytest.mark.parametrize("temperature", ["1e-320", "100000000000000000000", "-Infinity"])
def test_a_request_line_with_a_temperature_that_overflows_is_one_bad_line(tmp_path, capsys, port, temperature):
    """A whole-number temperature past int64 made torch and JAX raise where NumPy ran."""
    path = requests_file(tmp_path, f'{{"prompt": [1], "temperature": {temperature}}}')
    code, out, err = batch(capsys, port, "--requests", path)
    first, last = err.splitlines()
    assert first.startswith(f"error: line 1: temperature {json.loads(temperature)!r} {TEMPERATURE_RULE}"), first
    assert_one_error_line(code, out, last + "\n")


def weights_with(tmp_path: Path, **changes) -> Path:
    """The seed's weights with these config fields, in its own file."""
    config = dataclasses.replace(ModelConfig(), **changes)
    path = tmp_path / "w.safetensors"
    save_file(load_file(str(DEFAULT_WEIGHTS)), str(path), metadata={"config": json.dumps(dataclasses.asdict(config))})
    return path


CONFIG_FLOATS = {
    # a float32 subnormal: XLA flushes it to zero, and an all-zero row normalises to NaN in JAX alone
    "subnormal_norm_eps": (dict(norm_eps=1e-40), "config field norm_eps=1e-40 is below 1e-12"),
    "tiny_norm_eps": (dict(norm_eps=1e-13), "config field norm_eps=1e-13 is below 1e-12"),
    # angles past the positions: JAX's sin and cos parted from torch's at 1e-30
    "rope_theta_below_one": (dict(rope_theta=1e-30), "config field rope_theta=1e-30 must be in [1, 1e+12]"),
    "rope_theta_past_the_top": (
        dict(rope_theta=1e13),
        "config field rope_theta=10000000000000.0 must be in [1, 1e+12]",
    ),
    # an integer no float holds raised OverflowError
    "integer_norm_eps_past_any_float": (dict(norm_eps=10**400), "config field norm_eps=inf must be a finite number"),
    "integer_rope_theta_past_any_float": (dict(rope_theta=10**400), "config field rope_theta=inf must be a finite"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_FLOATS))
def test_a_config_float_past_where_the_ports_agree_is_refused_at_load(tmp_path, capsys, port, case):
    changes, expected = CONFIG_FLOATS[case]
    err = generate(capsys, port, "--weights", weights_with(tmp_path, **changes))
    assert err.startswith(f"error: {expected}"), err


HF_FLOATS = {
    "subnormal_rms_norm_eps": (dict(rms_norm_eps=1e-40), "config field norm_eps=1e-40 is below 1e-12"),
    "rope_theta_below_one": (
        dict(rope_parameters={"rope_theta": 0.5, "rope_type": "default"}),
        "config field rope_theta=0.5 must be in [1, 1e+12]",
    ),
    "integer_rms_norm_eps_past_any_float": (dict(rms_norm_eps=10**400), "rms_norm_eps=100000000000000000"),
}


@pytest.mark.parametrize("case", sorted(HF_FLOATS))
def test_a_config_float_past_where_the_ports_agree_is_refused_at_convert(tmp_path, capsys, case):
    changes, expected = HF_FLOATS[case]
    out = tmp_path / "w.safetensors"
    err = assert_one_error_line(*run_cli(capsys, "convert", "--from-hf", hf_dir(tmp_path, **changes), "--out", out))
    assert expected in err and not out.exists(), err


@pytest.mark.parametrize(
    "changes",
    [
        dict(rms_norm_eps=1e-12),
        dict(rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}),  # Llama 3
        dict(rope_parameters={"rope_theta": 3.6e9, "rope_type": "default"}),  # a long-context Llama 3
    ],
)
def test_published_config_floats_still_convert(tmp_path, capsys, changes):
    code, _, err = run_cli(capsys, "convert", "--from-hf", hf_dir(tmp_path, **changes), "--out", tmp_path / "w.st")
    assert (code, err) == (0, "")


# --- every file read is bounded before it is read ---------------------------------------


@pytest.mark.parametrize(
    "name, shown",
    [
        ("config.json", "config file 2.0 MiB, parsed config file 20.0 MiB"),
        ("model.safetensors.index.json", "safetensors index 2.0 MiB"),
    ],
)
def test_a_json_file_past_the_memory_limit_is_refused_unread(tmp_path, capsys, monkeypatch, name, shown):
    monkeypatch.setenv("KVPORTS_MAX_BYTES", "1M")
    directory = hf_dir(tmp_path)
    sparse(directory / name, 2 * MiB)
    err = assert_one_error_line(*run_cli(capsys, "convert", "--from-hf", directory, "--out", tmp_path / "w.st"))
    assert shown in err and "above the limit of 1.0 MiB" in err, err


def test_a_config_json_past_its_cap_is_refused_unread(tmp_path, capsys, monkeypatch):
    directory = hf_dir(tmp_path)
    sparse(directory / "config.json", 65 * MiB)

    def refuse(*args, **kwargs):
        raise AssertionError("config.json was read past its cap")

    monkeypatch.setattr(Path, "read_text", refuse)
    monkeypatch.setattr(Path, "read_bytes", refuse)
    err = assert_one_error_line(*run_cli(capsys, "convert", "--from-hf", directory, "--out", tmp_path / "w.st"))
    assert "config file" in err and "is 65.0 MiB, above the 64.0 MiB such a file may be" in err, err


def test_a_tokenizer_json_past_the_memory_limit_is_refused_unread(tmp_path, capsys, monkeypatch, port):
    pytest.importorskip("tokenizers")
    monkeypatch.setenv("KVPORTS_MAX_BYTES", "1M")
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    sparse(folder / "tokenizer.json", 2 * MiB)
    err = generate(capsys, port, "--tokenizer", folder, "--text", "w1")
    assert "tokenizer file 2.0 MiB, parsed tokenizer file 20.0 MiB" in err and "above the limit of 1.0 MiB" in err, err


# --- request files: split where JSONL does, one bad line at a time -----------------------


def test_a_request_line_nested_too_deep_is_one_bad_line(tmp_path, capsys, port):
    path = requests_file(tmp_path, "[" * 200_000 + "]" * 200_000, '{"prompt": [1, 2, 3]}')
    code, out, err = batch(capsys, port, "--requests", path, "--new-tokens", "2")
    assert code == 2 and err == "error: line 1: not valid JSON (nested too deeply)\n", err
    assert [json.loads(line).get("id") for line in out.splitlines()][:1] == ["2"]


def test_a_raw_line_separator_inside_a_json_string_does_not_end_the_line(tmp_path, capsys, port):
    """U+2028 may stand raw in a JSON string; str.splitlines would cut the line there."""
    line = json.dumps({"id": "a\u2028b\u0085c", "prompt": [1, 2, 3]}, ensure_ascii=False)
    code, out, err = batch(capsys, port, "--requests", requests_file(tmp_path, line), "--new-tokens", "2")
    assert (code, err) == (0, "")
    assert json.loads(out.splitlines()[0])["id"] == "a\u2028b\u0085c"


def test_request_lines_are_split_at_newlines_alone():
    assert split_lines('{"id": "a\u2028b"}\n\n{"id": "\x1c"}\r\n') == ['{"id": "a\u2028b"}', "", '{"id": "\x1c"}\r', ""]


def test_a_line_without_an_id_keeps_its_number_and_the_line_that_takes_it_is_refused():
    lines = ['{"id": 3, "prompt": [1]}', '{"prompt": [2]}', '{"prompt": [3]}', '{"id": "2", "prompt": [4]}']
    requests, bad = parse_requests(lines, ModelConfig(), default_new_tokens=2)
    assert [(request.id, request.prompt) for request in requests] == [("2", (2,)), ("3", (3,))]
    assert [str(line) for line in bad] == [
        "line 1: id '3' is line 3's (a line without an id is named by its number)",
        "line 4: id '2' is line 2's (a line without an id is named by its number)",
    ]


def test_an_id_a_bad_line_would_have_had_is_free_and_a_repeated_id_names_its_first_line():
    lines = ['{"id": 2, "prompt": [1]}', '{"prompt": []}', '{"id": "x", "prompt": [1]}', '{"id": "x", "prompt": [1]}']
    requests, bad = parse_requests(lines, ModelConfig(), default_new_tokens=2)
    assert [request.id for request in requests] == ["2", "x"]
    assert [str(line) for line in bad][1] == "line 4: id 'x' is already used by line 3"


# --- outputs: nothing lost -------------------------------------------------------------


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


def dangling_symlink(tmp_path: Path) -> Path:
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    return tmp_path / "link"


NOT_REGULAR = {
    "fifo": (fifo, "is not a regular file; kvports replaces only a regular file"),
    "symlink_to_a_file": (symlink_to_a_file, "is a symbolic link; kvports replaces only a regular file"),
    "dangling_symlink": (dangling_symlink, "is a symbolic link; kvports replaces only a regular file"),
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


# --- the block pool --------------------------------------------------------------------


@pytest.fixture
def long_context(tmp_path):
    """A tiny Llama with a context of 2**26 tokens: a default pool of 32 such sequences is 2**31 slots."""
    config = dataclasses.replace(TINY_FAMILIES["llama"], max_seq_len=2**26).validate()
    weights = tmp_path / "long.safetensors"
    save_weights(weights, gpt2_init_weights(config), config)
    return weights


def test_a_context_too_long_for_the_default_pool_is_told_the_flag_that_sets_it(tmp_path, capsys, port, long_context):
    long_request = json.dumps({"prompt": [1], "max_new_tokens": 2**26 - 1})  # the whole context
    code, out, err = batch(capsys, port, "--requests", requests_file(tmp_path, long_request), "--weights", long_context)
    assert assert_one_error_line(code, out, err) == (
        "error: pool slots (num blocks x block size) 2147483648 is above 1073741824: set a smaller pool with "
        "--num-blocks (by default --max-batch 32 sequences of 67108864 tokens)\n"
    )


def test_the_default_pool_is_sized_for_the_requests_not_the_models_context(tmp_path, capsys, port, long_context):
    code, out, err = batch(
        capsys, port, "--requests", requests_file(tmp_path, '{"prompt": [1]}'), "--weights", long_context
    )
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["summary"]["blocks"]["num_blocks"] == 32 * 2  # 17 tokens: 2 blocks each
