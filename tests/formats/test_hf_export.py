"""Files transformers writes and reads: our gpt2 export run by transformers, and its
sharded and bfloat16 checkpoints converted by us."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")
import torch

from kvports.cli import main
from kvports.formats.hf import import_hf
from kvports.formats.weights import DEFAULT_WEIGHTS
from tests.helpers.agreement import assert_same_tensors
from tests.helpers.hf_reference import CASES
from tests.helpers.models import GOLDEN, SEED_PROMPT

pytestmark = pytest.mark.slow


def test_exported_seed_model_gives_golden_tokens_in_transformers(tmp_path):
    from transformers import GPT2LMHeadModel

    assert main(["convert", "--to-hf", str(DEFAULT_WEIGHTS), "--out", str(tmp_path / "seed")]) == 0
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "seed").eval()
    prompt = torch.from_numpy(SEED_PROMPT)
    with torch.no_grad():
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=len(GOLDEN), do_sample=False
        )
    assert out[0, SEED_PROMPT.shape[1] :].tolist() == GOLDEN


def test_transformers_sharded_checkpoint_converts_like_one_file(tmp_path):
    model = CASES["llama-gqa-untied"].build()
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    _, one = import_hf(tmp_path / "one")
    _, sharded = import_hf(tmp_path / "sharded")
    assert_same_tensors(one, sharded)


def test_transformers_bfloat16_checkpoint_casts_to_the_same_values(tmp_path):
    model = CASES["mistral-window"].build().to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    _, tensors = import_hf(tmp_path / "bf16", "float32")
    expected = model.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(tensors["emb.weight"], expected)
