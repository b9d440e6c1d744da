"""Real config.json files of public checkpoints (tests/fixtures/hf_configs, as their hubs serve
them): each accepted as the model it describes, or refused by the one field that would change
the forward pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvports.families import describe
from kvports.formats.hf.exporter import hf_refusal
from kvports.formats.hf.hf_config import config_from_hf, llama_hf_config
from kvports.shared.errors import UserError

FIXTURES = Path(__file__).parent / "fixtures" / "hf_configs"

# name -> (family, d_model, n_heads, kv_heads, n_layers, ffn_dim, vocab, tied, eos ids)
ACCEPTED = {
    "SmolLM2-135M": ("llama", 576, 9, 3, 30, 1536, 49152, True, (0,)),
    "SmolLM2-135M-Instruct": ("llama", 576, 9, 3, 30, 1536, 49152, True, (2,)),
    "SmolLM2-360M": ("llama", 960, 15, 5, 32, 2560, 49152, True, (0,)),
    "TinyLlama-1.1B-Chat-v1.0": ("llama", 2048, 32, 4, 22, 5632, 32000, False, (2,)),
    "Mistral-7B-v0.1": ("mistral", 4096, 32, 8, 32, 14336, 32000, False, (2,)),
    "gpt2": ("gpt2", 768, 12, 12, 12, 3072, 50257, True, (50256,)),
    "gpt2-medium": ("gpt2", 1024, 16, 16, 24, 4096, 50257, True, (50256,)),
    "Llama-3.2-1B": ("llama3", 2048, 32, 8, 16, 8192, 128256, True, (128001,)),
    "Qwen2.5-0.5B": ("qwen2", 896, 14, 2, 24, 4864, 151936, True, (151643,)),
}


def read(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def test_every_fixture_is_listed():
    assert sorted(p.stem for p in FIXTURES.glob("*.json")) == sorted(ACCEPTED)


@pytest.mark.parametrize("name", ACCEPTED)
def test_real_config_is_accepted_as_the_model_it_describes(name):
    config = config_from_hf(read(name))
    found = (config.family, config.d_model, config.n_heads, config.kv_heads, config.n_layers, config.ffn_dim)
    assert (*found, config.vocab_size, config.tie_embeddings, config.eos_token_ids) == ACCEPTED[name]


def test_smollm2_config_keeps_its_rope_theta():
    assert config_from_hf(read("SmolLM2-135M")).rope_theta == 100000.0


def test_llama_3_config_keeps_its_rope_scaling():
    config = config_from_hf(read("Llama-3.2-1B"))
    scaling = (config.rope_scaling, config.rope_factor, config.rope_low_freq_factor, config.rope_high_freq_factor)
    assert (*scaling, config.rope_original_len, config.rope_theta) == ("llama3", 32.0, 1.0, 4.0, 8192, 500000.0)


@pytest.mark.parametrize(
    "name, field, value, needle",
    [
        ("Llama-3.2-1B", "rope_scaling", {"rope_type": "yarn", "factor": 4.0}, 'rope_scaling.rope_type="yarn"'),
        ("Llama-3.2-1B", "rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "rope_scaling.low_freq_factor=null"),
        ("Qwen2.5-0.5B", "use_sliding_window", True, "use_sliding_window=true"),
        ("Qwen2.5-0.5B", "use_mrope", True, "use_mrope=true"),
        ("Qwen2.5-0.5B", "model_type", "qwen2_moe", 'model_type="qwen2_moe"'),
    ],
)
def test_a_new_family_is_refused_by_the_field_kvports_does_not_model(name, field, value, needle):
    with pytest.raises(UserError, match=needle.replace("(", r"\(")):
        config_from_hf({**read(name), field: value})


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("rope_interleaved", True, "rope_interleaved=true"),
        ("attention_bias", "yes", 'attention_bias="yes"'),
        ("head_dim", 0, "head_dim=0"),
        ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, "rope_scaling.rope_type="),
        ("qk_norm", True, "qk_norm=true"),
    ],
)
def test_a_field_that_changes_the_forward_pass_is_still_refused(field, value, needle):
    with pytest.raises(UserError, match=needle.replace("(", r"\(")):
        config_from_hf({**read("SmolLM2-135M"), field: value})


@pytest.mark.parametrize(
    "field", ["unk_token_id", "sep_token_id", "_commit_hash", "architectures", "transformers_version"]
)
def test_a_field_that_only_names_things_is_accepted(field):
    assert config_from_hf({**read("TinyLlama-1.1B-Chat-v1.0"), field: 7}) == config_from_hf(
        read("TinyLlama-1.1B-Chat-v1.0")
    )


def test_gpt2_n_special_other_than_zero_is_refused():
    with pytest.raises(UserError, match="n_special=2"):
        config_from_hf({**read("gpt2-medium"), "n_special": 2})


def test_llama_3_rope_scaling_survives_the_way_back_to_a_config_json():
    config = config_from_hf(read("Llama-3.2-1B"))
    assert config_from_hf(llama_hf_config(config, "float32")) == config


def test_a_family_llama_cannot_express_is_refused_on_the_way_back():
    assert hf_refusal(config_from_hf(read("Qwen2.5-0.5B"))) == (
        "a qwen2 model: kvports writes Llama and Mistral directories only"
    )


def test_the_description_names_the_family_and_its_switches():
    qwen3 = config_from_hf({**read("Qwen2.5-0.5B"), "model_type": "qwen3", "head_dim": 128, "num_key_value_heads": 7})
    assert describe(qwen3) == "qwen3 model (GQA 14q/7kv, qk-norm, tied head)"
    assert describe(config_from_hf(read("Llama-3.2-1B"))) == "llama3 model (GQA 32q/8kv, RoPE llama3 x32, tied head)"
