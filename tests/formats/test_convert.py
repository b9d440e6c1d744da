"""`kvports convert` and text prompts: what is accepted, and every refusal's one line.

NumPy only (no transformers): the Hugging Face directories here are written by hand,
with the names, layouts and config.json fields transformers 5 writes. Agreement with
transformers itself is tests/test_hf_agreement.py.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kvports import registry
from kvports.formats.hf import import_hf
from kvports.formats.weights import DEFAULT_WEIGHTS, gpt2_init_weights, load_weights, save_weights
from kvports.shared.config import ModelConfig
from tests.helpers.agreement import assert_same_tensors
from tests.helpers.commands import assert_one_error_line, run_cli
from tests.helpers.hf_files import D, F, V, llama_config, llama_tensors, mistral_config, write_hf_dir


@pytest.fixture
def llama_dir(tmp_path):
    config = llama_config()
    return write_hf_dir(tmp_path / "llama", config, llama_tensors(config))


def edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def edit_tensors(directory: Path, edit) -> None:
    tensors = load_file(str(directory / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def write_bf16_safetensors(path: Path, tensors: dict) -> None:
    """NumPy has no bfloat16, so the file is written by hand: each value's top 16 bits."""
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        bits = (np.ascontiguousarray(array, dtype=np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(array.shape), "data_offsets": [offset, offset + len(bits)]}
        blobs.append(bits)
        offset += len(bits)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def convert(capsys, *argv):
    """(exit status, stdout, stderr) of `kvports convert ...`."""
    return run_cli(capsys, "convert", *argv)


def refused(capsys, *argv) -> str:
    """The one error line of a refused `kvports convert ...`."""
    return assert_one_error_line(*convert(capsys, *argv))


# --- accepted -------------------------------------------------------------------------


def test_llama_directory_converts_to_our_names_and_layouts(llama_dir, tmp_path, capsys):
    status, out, _ = convert(capsys, "--from-hf", llama_dir, "--out", tmp_path / "m.safetensors")
    assert status == 0 and "llama model (GQA 4q/2kv, untied head)" in out
    config, tensors = load_weights(tmp_path / "m.safetensors")
    hf = load_file(str(llama_dir / "model.safetensors"))
    assert (config.family, config.n_kv_heads, config.positions, config.activation) == ("llama", 2, "rope", "swiglu")
    p = "model.layers.1."
    expected_qkv = np.concatenate(
        [hf[p + "self_attn.q_proj.weight"], hf[p + "self_attn.k_proj.weight"], hf[p + "self_attn.v_proj.weight"]]
    )
    np.testing.assert_array_equal(tensors["blocks.1.qkv.weight"], expected_qkv)
    expected_ffn = np.concatenate([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
    np.testing.assert_array_equal(tensors["blocks.1.ffn.0.weight"], expected_ffn)
    np.testing.assert_array_equal(tensors["blocks.1.ln2.weight"], hf[p + "post_attention_layernorm.weight"])


def test_llama_4x_config_with_top_level_rope_theta_converts(llama_dir):
    config = llama_config(rope_theta=500000.0, rope_scaling=None)
    del config["rope_parameters"]
    (llama_dir / "config.json").write_text(json.dumps(config))
    config, _ = import_hf(llama_dir)
    assert config.rope_theta == 500000.0


def test_mistral_directory_converts_with_its_window(tmp_path):
    config = mistral_config()
    ours, _ = import_hf(write_hf_dir(tmp_path / "mistral", config, llama_tensors(config)))
    assert (ours.family, ours.sliding_window) == ("mistral", 4)


def test_tied_llama_has_no_head_tensor(tmp_path):
    config = llama_config(tie_word_embeddings=True)
    ours, tensors = import_hf(write_hf_dir(tmp_path / "tied", config, llama_tensors(config)))
    assert ours.tie_embeddings and "head.weight" not in tensors


def test_sharded_checkpoint_converts_like_one_file(llama_dir, tmp_path):
    tensors = load_file(str(llama_dir / "model.safetensors"))
    names = sorted(tensors)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((llama_dir / "config.json").read_text())
    weight_map = {}
    for index, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        shard = f"model-{index + 1:05d}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, str(sharded / shard), metadata={"format": "pt"})
        weight_map.update({name: shard for name in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _, one = import_hf(llama_dir)
    _, many = import_hf(sharded)
    assert_same_tensors(one, many)


def test_float64_checkpoint_stays_float64(llama_dir):
    edit_tensors(llama_dir, lambda t: t.update({k: v.astype(np.float64) for k, v in t.items()}))
    _, tensors = import_hf(llama_dir)
    assert {str(a.dtype) for a in tensors.values()} == {"float64"}


def test_bf16_checkpoint_casts_exactly_with_dtype(llama_dir, tmp_path, capsys):
    tensors = load_file(str(llama_dir / "model.safetensors"))
    (llama_dir / "model.safetensors").unlink()
    write_bf16_safetensors(llama_dir / "model.safetensors", tensors)
    status, _, _ = convert(capsys, "--from-hf", llama_dir, "--out", tmp_path / "m.safetensors", "--dtype", "float32")
    assert status == 0
    _, ours = load_weights(tmp_path / "m.safetensors")
    truncated = (tensors["model.embed_tokens.weight"].view(np.uint32) & 0xFFFF0000).view(np.float32)
    np.testing.assert_array_equal(ours["emb.weight"], truncated)


def test_fp16_checkpoint_casts_with_dtype(llama_dir):
    edit_tensors(llama_dir, lambda t: t.update({k: v.astype(np.float16) for k, v in t.items()}))
    _, tensors = import_hf(llama_dir, "float64")
    assert tensors["emb.weight"].dtype == np.float64


# --- refused: config ------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("model_type", "bert", 'model_type="bert"'),
        ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope_scaling="),
        (
            "rope_parameters",
            {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 8.0},
            'rope_parameters.rope_type="yarn"',
        ),
        ("head_dim", 7, "head_dim=7"),  # RoPE rotates pairs: an odd head size has none for its last dim
        ("hidden_act", "gelu", 'hidden_act="gelu"'),
        ("sliding_window", 4, "sliding_window=4"),  # Llama has no window: transformers would ignore it
        ("qk_layernorm", True, "qk_layernorm=true"),
        ("num_key_value_heads", 3, "num_key_value_heads=3"),
    ],
)
def test_llama_field_we_do_not_model_is_refused_by_name(llama_dir, tmp_path, capsys, field, value, needle):
    edit_config(llama_dir, **{field: value})
    assert needle in refused(capsys, "--from-hf", llama_dir, "--out", tmp_path / "m.safetensors")


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("attention_bias", True, "attention_bias=true"),
        ("sliding_window", 0, "sliding_window=0"),
        ("sliding_window", 4.5, "sliding_window=4.5"),
    ],
)
def test_mistral_field_we_cannot_honour_is_refused_by_name(tmp_path, capsys, field, value, needle):
    config = mistral_config(**{field: value})
    directory = write_hf_dir(tmp_path / "mistral", config, llama_tensors(config))
    assert needle in refused(capsys, "--from-hf", directory, "--out", tmp_path / "m.safetensors")


@pytest.fixture
def gpt2_dir(tmp_path, capsys):
    """The shipped seed model written as gpt2 (no transformers needed)."""
    status, _, _ = convert(capsys, "--to-hf", DEFAULT_WEIGHTS, "--out", tmp_path / "gpt2")
    assert status == 0
    return tmp_path / "gpt2"


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("scale_attn_by_inverse_layer_idx", True, "scale_attn_by_inverse_layer_idx=true"),
        ("scale_attn_weights", False, "scale_attn_weights=false"),
        ("activation_function", "relu", 'activation_function="relu"'),
        ("add_cross_attention", True, "add_cross_attention=true"),
    ],
)
def test_gpt2_field_we_do_not_model_is_refused_by_name(gpt2_dir, tmp_path, capsys, field, value, needle):
    edit_config(gpt2_dir, **{field: value})
    assert needle in refused(capsys, "--from-hf", gpt2_dir, "--out", tmp_path / "m.safetensors")


# --- refused: tensors and files -------------------------------------------------------


def test_missing_tensor_is_named(llama_dir, tmp_path, capsys):
    edit_tensors(llama_dir, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    err = refused(capsys, "--from-hf", llama_dir, "--out", tmp_path / "m.safetensors")
    assert "missing tensor 'model.layers.1.self_attn.k_proj.weight'" in err and "[8, 16]" in err


def test_misshaped_tensor_is_named_with_both_shapes(llama_dir, tmp_path, capsys):
    edit_tensors(llama_dir, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": np.zeros((F + 1, D), np.float32)}))
    err = refused(capsys, "--from-hf", llama_dir, "--out", tmp_path / "m.safetensors")
    assert "'model.layers.0.mlp.up_proj.weight' has shape [25, 16], the config needs [24, 16]" in err


def test_unexpected_tensor_is_named(llama_dir, tmp_path, capsys):
    edit_tensors(llama_dir, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": np.ones(4, np.float32)}))
    err = refused(capsys, "--from-hf", llama_dir, "--out", tmp_path / "m.safetensors")
    assert "unexpected tensor 'model.layers.0.self_attn.q_norm.weight'" in err


def test_bias_tensors_without_the_config_flag_are_refused(llama_dir, tmp_path, capsys):
    edit_tensors(llama_dir, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": np.ones(D, np.float32)}))
    assert "'model.layers.0.self_attn.o_proj.bias'" in refused(
        capsys, "--from-hf", llama_dir, "--out", tmp_path / "m.st"
    )


def test_tied_config_with_a_different_head_is_refused(llama_dir, tmp_path, capsys):
    edit_config(llama_dir, tie_word_embeddings=True)
    assert "lm_head.weight" in refused(capsys, "--from-hf", llama_dir, "--out", tmp_path / "m.safetensors")


def test_half_precision_without_dtype_is_refused(llama_dir, tmp_path, capsys):
    edit_tensors(llama_dir, lambda t: t.update({k: v.astype(np.float16) for k, v in t.items()}))
    err = refused(capsys, "--from-hf", llama_dir, "--out", tmp_path / "m.safetensors")
    assert "dtype F16" in err and "--dtype" in err


def test_bf16_without_dtype_is_refused(llama_dir, tmp_path, capsys):
    tensors = load_file(str(llama_dir / "model.safetensors"))
    write_bf16_safetensors(llama_dir / "model.safetensors", tensors)
    err = refused(capsys, "--from-hf", llama_dir, "--out", tmp_path / "m.safetensors")
    assert "dtype BF16" in err and "--dtype" in err


def test_pickle_checkpoint_is_refused_unopened(llama_dir, tmp_path, capsys):
    (llama_dir / "model.safetensors").unlink()
    (llama_dir / "pytorch_model.bin").write_bytes(b"not even a pickle: it must never be opened")
    err = refused(capsys, "--from-hf", llama_dir, "--out", tmp_path / "m.safetensors")
    assert "pytorch_model.bin" in err and "no *.safetensors" in err


def test_directory_without_config_is_refused(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert "no config.json" in refused(capsys, "--from-hf", tmp_path / "empty", "--out", tmp_path / "m.safetensors")


def test_existing_output_needs_force(llama_dir, tmp_path, capsys):
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"keep me")
    assert "--force" in refused(capsys, "--from-hf", llama_dir, "--out", out)
    assert out.read_bytes() == b"keep me"


def test_refused_conversion_writes_nothing(llama_dir, tmp_path, capsys):
    edit_config(llama_dir, head_dim=8)
    refused(capsys, "--from-hf", llama_dir, "--out", tmp_path / "m.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama"]


# --- export ---------------------------------------------------------------------------


def test_to_hf_round_trip_is_exact(gpt2_dir, tmp_path, capsys):
    status, out, _ = convert(capsys, "--from-hf", gpt2_dir, "--out", tmp_path / "back.safetensors")
    assert status == 0 and "seed-gpt model" in out
    config, tensors = load_weights(tmp_path / "back.safetensors")
    seed_config, seed_tensors = load_weights(DEFAULT_WEIGHTS)
    assert config == seed_config
    for name, array in seed_tensors.items():
        np.testing.assert_array_equal(tensors[name], array)


def test_to_hf_writes_back_the_checkpoints_bos_and_eos_ids(gpt2_dir, tmp_path, capsys):
    edit_config(gpt2_dir, bos_token_id=7, eos_token_id=8)
    assert convert(capsys, "--from-hf", gpt2_dir, "--out", tmp_path / "ours.safetensors")[0] == 0
    assert convert(capsys, "--to-hf", tmp_path / "ours.safetensors", "--out", tmp_path / "back")[0] == 0
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"]) == (7, 8)


def test_to_hf_writes_conv1d_layout(gpt2_dir):
    _, seed = load_weights(DEFAULT_WEIGHTS)
    hf = load_file(str(gpt2_dir / "model.safetensors"))
    np.testing.assert_array_equal(hf["transformer.h.0.mlp.c_fc.weight"], seed["blocks.0.ffn.0.weight"].T)


def test_to_hf_writes_a_llama_back_exactly(llama_dir, tmp_path, capsys):
    assert convert(capsys, "--from-hf", llama_dir, "--out", tmp_path / "llama.safetensors")[0] == 0
    assert convert(capsys, "--to-hf", tmp_path / "llama.safetensors", "--out", tmp_path / "back")[0] == 0
    assert convert(capsys, "--from-hf", tmp_path / "back", "--out", tmp_path / "again.safetensors")[0] == 0
    assert_same_tensors(
        load_weights(tmp_path / "llama.safetensors")[1], load_weights(tmp_path / "again.safetensors")[1]
    )


def test_to_hf_refuses_a_model_no_hugging_face_class_expresses(tmp_path, capsys):
    config = ModelConfig(positions="rope", vocab_size=32, d_model=16, n_heads=2, n_layers=1, max_seq_len=8)
    save_weights(tmp_path / "odd.safetensors", gpt2_init_weights(config), config)
    err = refused(capsys, "--to-hf", tmp_path / "odd.safetensors", "--out", tmp_path / "out")
    assert "Llama and Mistral have RoPE, RMSNorm and SwiGLU" in err
    assert not (tmp_path / "out").exists()


def test_to_hf_over_an_existing_model_needs_force(gpt2_dir, capsys):
    assert "--force" in refused(capsys, "--to-hf", DEFAULT_WEIGHTS, "--out", gpt2_dir)
    assert convert(capsys, "--to-hf", DEFAULT_WEIGHTS, "--out", gpt2_dir, "--force")[0] == 0


# --- text prompts and the family on show ----------------------------------------------


@pytest.fixture
def llama_with_tokenizer(llama_dir, tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tokenizer = tokenizers.Tokenizer(WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(llama_dir / "tokenizer.json"))
    assert convert(capsys, "--from-hf", llama_dir, "--out", tmp_path / "m.safetensors")[0] == 0
    return llama_dir, tmp_path / "m.safetensors"


def test_generate_encodes_text_and_prints_decoded_text(llama_with_tokenizer, capsys):
    directory, weights = llama_with_tokenizer
    status, out, _ = run_cli(
        capsys,
        "generate",
        "--framework",
        "numpy",
        "--mode",
        "cached",
        "--weights",
        weights,
        "--tokenizer",
        directory,
        "--text",
        "w3 w1 w4",
        "--new-tokens",
        "4",
        "--json",
    )
    result = json.loads(out)
    assert status == 0 and result["tokens"][0][:3] == [3, 1, 4]
    assert result["text"] == [" ".join(f"w{i}" for i in result["tokens"][0])]


def test_text_without_tokenizer_is_refused(capsys):
    err = assert_one_error_line(
        *run_cli(capsys, "generate", "--framework", "numpy", "--mode", "cached", "--text", "hello")
    )
    assert "--tokenizer" in err


def test_tokenizer_folder_without_tokenizer_json_is_refused(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    err = assert_one_error_line(
        *run_cli(
            capsys, "generate", "--framework", "numpy", "--mode", "cached", "--tokenizer", tmp_path, "--text", "hi"
        )
    )
    assert "no tokenizer.json" in err


def test_compare_reports_the_family(tmp_path, capsys, monkeypatch):
    real = registry.available_port
    monkeypatch.setattr(
        registry, "available_port", lambda name: real(name) if name == "numpy" else None
    )  # one is enough
    config = mistral_config()
    directory = write_hf_dir(tmp_path / "mistral", config, llama_tensors(config))
    assert convert(capsys, "--from-hf", directory, "--out", tmp_path / "m.safetensors")[0] == 0
    status, out, _ = run_cli(
        capsys, "compare", "--weights", tmp_path / "m.safetensors", "--prompt", "1,2,3", "--new-tokens", "2", "--json"
    )
    assert status == 0 and json.loads(out)["family"] == "mistral"
