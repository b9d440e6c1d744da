"""Real third-party code through `kvports check`: transformers' own GPT-2, Llama and Mistral
classes behind an adapter that calls them as their users do (keyword arguments, a
DynamicCache, float64 weights). Each passes with exit status 0, Llama's and Mistral's float64
rows as float32 inside (their RMSNorm and RoPE tables compute in float32); the same adapter
with positions restarting at 0 in each cached call is named position_offset."""

from __future__ import annotations

import pytest

from tests.helpers.checker import HF_ADAPTER, check_json, variant

pytest.importorskip("transformers")
FAMILIES = ("gpt2", "llama", "mistral")


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_own_model_passes_float64_included(family):
    code, report = check_json(HF_ADAPTER, family)
    rows = {check["name"]: check for check in report["checks"]}
    assert (code, report["diagnoses"]) == (0, [])
    assert {row["status"] for row in rows.values()} <= {"pass", "noise", "noise-f32"}
    float64 = rows["full logits float64, T=48"]
    assert "cached == full float64, P=5 + 15 steps" in rows
    if family != "gpt2":  # RMSNorm and the RoPE tables in float32 inside a float64 run: said so, and no failure
        assert float64["status"] == "noise-f32" and 1e-10 < float64["max_abs_diff"] < 1e-4
        assert "computes in float32 inside (RMSNorm/RoPE" in float64["detail"]
    prefill = rows["prefill: one forward for the prompt"]  # seen through a keyword call (input_ids=...)
    assert prefill["status"] == "pass" and "the first [1, 16]" in prefill["detail"]


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_with_positions_restarting_is_a_position_offset(tmp_path, family):
    restarting = variant(tmp_path, HF_ADAPTER, "RESTART_POSITIONS = False", "RESTART_POSITIONS = True")
    code, report = check_json(restarting, family, quick=True)
    assert (code, report["diagnoses"]) == (1, ["position_offset"])


def test_a_bfloat16_model_is_told_its_dtype_and_passes_at_its_precision(tmp_path):
    in_bfloat16 = variant(
        tmp_path, HF_ADAPTER, "return model.to(dtype).eval()", "return model.to(torch.bfloat16).eval()"
    )
    code, report = check_json(in_bfloat16, "llama", quick=True)
    assert (code, report["diagnoses"]) == (0, [])
    assert report["notes"] and report["notes"][0].startswith("the implementation returns bfloat16 logits")
    assert [check for check in report["checks"] if check["status"] == "noise" and "logit diff" in check["detail"]]
