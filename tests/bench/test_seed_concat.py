"""seed-concat, the bench's copy of the seed's own model, runs only the architectures it has a place
for: the seed's and GPT-2's. Any field a family added is refused by name, rather than run without it."""

from __future__ import annotations

import dataclasses

import pytest

from kvports.shared.config import ModelConfig
from tests.helpers.models import TINY_FAMILIES

pytest.importorskip("torch")

from kvports.baselines.seed_concat import check_seed_shaped

SEED = ModelConfig()
# One value each family's own field takes (Qwen2.5's q/k/v bias, Qwen3's q/k norms, Gemma 3's post-norms,
# embedding and attention scales, a head size apart from d_model / n_heads), and the seed's shapes changed.
FAMILY_FIELDS = {
    "qkv_bias": dict(qkv_bias=True, attn_bias=False),
    "qk_norm": dict(qk_norm=True),
    "post_norms": dict(post_norms=True),
    "embed_scale": dict(embed_scale=11.3),
    "attn_scale": dict(attn_scale=0.2),
    "head_size": dict(head_size=16),
    "n_kv_heads": dict(n_kv_heads=2),
    "ffn_hidden": dict(ffn_hidden=300),
    "sliding_window": dict(sliding_window=8),
    "positions": dict(positions="rope"),
    "norm": dict(norm="rmsnorm"),
}


@pytest.mark.parametrize("field", sorted(FAMILY_FIELDS))
def test_a_field_the_seed_has_no_place_for_is_refused_by_name(field):
    with pytest.raises(ValueError, match=rf"differs in .*\b{field}\b"):
        check_seed_shaped(dataclasses.replace(SEED, **FAMILY_FIELDS[field]))


@pytest.mark.parametrize(
    "config",
    [SEED, TINY_FAMILIES["gpt2"], dataclasses.replace(SEED, n_kv_heads=4, ffn_hidden=512, head_size=32)],
    ids=["seed", "gpt2", "seed-spelled-out"],
)
def test_the_seeds_and_gpt2s_shapes_are_taken(config):
    check_seed_shaped(config)
