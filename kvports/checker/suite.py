"""The checks `kvports check` runs, and the diagnosis of what fails.

Every figure is held to a reference port (NumPy, always installed; torch's for a torch
implementation where torch is present) on the same inputs: golden tokens, full-forward
logits at every position, cached logits at every step, prompts of length 1, a few and the
maximum, a batch of 3. A logit difference within float noise is reported with its size, a
token difference at one of the reference's near-ties with its margin; anything else is a
defect, located (step, row, position) and matched against the known mistakes
(`variants.py`, run on the same inputs).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import replace
from types import ModuleType
from typing import Any

import numpy as np

from kvports import generating, loading, registry
from kvports.agreement import NEAR_TIE, compare_tokens, top2_margin
from kvports.checker import variants
from kvports.checker.implementation import Implementation
from kvports.checker.plugin import ImplementationError, load_implementation
from kvports.checker.report import FAIL, NOISE, NOISE_F32, PASS, SKIP, Check, Report, failing
from kvports.formats.weights import gpt2_init_weights, load_weights
from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError
from kvports.shared.generation import GenerationConfig

FAMILIES = ("seed", "gpt2", "gpt2-window", "llama", "mistral", "llama3", "qwen2", "qwen3", "gemma3")
SEED_PROMPT = np.array([[160, 248, 104, 209, 394]], dtype=np.int64)  # [1, 5]: the seed's demo prompt
GOLDEN_TOKENS = 100  # the seed's README generates 100 tokens; tests/helpers/models.py GOLDEN holds them
TOLERANCE = {"float32": 1e-4, "float64": 1e-10}  # |logit diff| float noise may reach (float32 ports sit near 1e-6)
# Logits an implementation returns in a 16-bit type are held at that type's precision, relative to the largest logit.
LOW_PRECISION_TOLERANCE = {"bfloat16": 5e-2, "float16": 1e-2}
MATCH = 1e-3  # a broken variant whose logits are this close to the implementation's is its signature
_NORM_POSITIONS_GELU = (
    "LayerNorm (weight and bias, eps {eps}), learned positions added to the embeddings, GELU ({gelu})"
)
_LLAMA_PARTS = (
    "RMSNorm (weight only, eps inside the square root), RoPE (half-split pairs (i, i + Dh/2) as transformers' Llama; "
    "an interleaved implementation permutes q and k rows), SwiGLU (ffn.0 holds gate then up), "
    "GQA (query head h reads key/value head h // (H / Hkv))"
)
# What a full forward that differs from the reference should be compared on, family by family.
FAMILY_PARTS = {
    "seed": _NORM_POSITIONS_GELU.format(eps="1e-5", gelu="exact, erf") + ", q/k/v order in qkv, the untied head",
    "gpt2": _NORM_POSITIONS_GELU.format(eps="1e-5", gelu="tanh") + ", q/k/v order in qkv, the head tied to emb",
    "gpt2-window": _NORM_POSITIONS_GELU.format(eps="1e-5", gelu="tanh")
    + ", q/k/v order in qkv, the head tied to emb, the sliding window (W keys including the current token)",
    "llama": _LLAMA_PARTS + ", q/k/v order in qkv, the untied head",
    "mistral": _LLAMA_PARTS + ", the sliding window (W keys including the current token), the head tied to emb",
    "llama3": _LLAMA_PARTS + ", Llama 3's RoPE frequencies (low ones divided by rope_factor, middle ones blended)",
    "qwen2": _LLAMA_PARTS + ", the biases on q, k and v (none on proj), the head tied to emb",
    "qwen3": _LLAMA_PARTS
    + ", q_norm and k_norm (RMSNorm over each head's Dh, before RoPE), head_size 16 (q is H x 16)",
    "gemma3": _LLAMA_PARTS.replace("SwiGLU", "GELU(tanh)-gated MLP")
    + ", embeddings times embed_scale, qk-norm, ln1_post/ln2_post on attention's and the MLP's outputs, "
    "the scale attn_scale, window 4 in layer 0 (RoPE base rope_local_theta) and none in layer 1, the head tied",
}
# What correct code commonly computes in float32 inside a float64 run, family by family.
FLOAT32_PARTS = {family: "LayerNorm/GELU/softmax" for family in ("seed", "gpt2", "gpt2-window")}
FLOAT32_PARTS |= {
    family: "RMSNorm/RoPE/softmax" for family in ("llama", "mistral", "llama3", "qwen2", "qwen3", "gemma3")
}
_LLAMA = dict(positions="rope", norm="rmsnorm", activation="swiglu", attn_bias=False, ffn_bias=False)
SMALL = dict(vocab_size=64, d_model=32, n_heads=4, n_layers=2, max_seq_len=48)
LLAMA = ModelConfig(**SMALL, **_LLAMA, n_kv_heads=2)  # type: ignore[arg-type]
# The other families at a test's size: tied GPT-2 (and with a window of 4: a window without RoPE),
# GQA Llama, Mistral with a window of 4, and the families built on Llama, each with its switches.
FAMILY_CONFIGS = {
    "gpt2": ModelConfig(**SMALL, activation="gelu_tanh", tie_embeddings=True),  # type: ignore[arg-type]
    "gpt2-window": ModelConfig(**SMALL, activation="gelu_tanh", tie_embeddings=True, sliding_window=4),  # type: ignore[arg-type]
    "llama": LLAMA,
    "mistral": ModelConfig(**SMALL, **_LLAMA, n_kv_heads=2, sliding_window=4, tie_embeddings=True),  # type: ignore[arg-type]
    # Llama 3's scaling with original_len 16 at Dh 8: one frequency kept, one blended, two divided.
    "llama3": replace(LLAMA, rope_theta=500000.0, rope_scaling="llama3", rope_factor=8.0, rope_original_len=16),
    "qwen2": replace(LLAMA, qkv_bias=True, tie_embeddings=True),
    "qwen3": replace(LLAMA, qk_norm=True, head_size=16),
    "gemma3": replace(
        LLAMA,
        activation="geglu_tanh",
        n_kv_heads=1,
        head_size=16,
        qk_norm=True,
        post_norms=True,
        embed_scale=float(np.float32(np.sqrt(32))),  # sqrt(d_model), rounded to float32 as transformers does
        attn_scale=24**-0.5,
        sliding_window=4,
        global_layers=(1,),
        rope_theta=1000000.0,
        rope_local_theta=10000.0,
        tie_embeddings=True,
    ),
}


def family_weights(family: str, dtype: str = "float32") -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """The seed's shipped model, or a small random one of the family (GPT-2's initialisation,
    its matrices scaled up tenfold so that the top two logits stand well apart)."""
    if family == "seed":
        return load_weights(dtype=dtype)
    if family not in FAMILY_CONFIGS:
        raise UserError(f"--family {family!r} is not one of {', '.join(FAMILIES)}")
    config = FAMILY_CONFIGS[family]
    weights = {name: array * 10 if array.ndim == 2 else array for name, array in gpt2_init_weights(config).items()}
    return config, {name: array.astype(dtype) for name, array in weights.items()}


def random_tokens(config: ModelConfig, batch: int, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, config.vocab_size, size=(batch, length), dtype=np.int64)


def where(step: int | None, row: int, position: int) -> str:
    return (f"step {step}, " if step is not None else "") + f"row {row}, position {position}"


def compare_logits(
    name: str, reference: np.ndarray, logits: np.ndarray, tolerance: float, prompt_len: int | None, against: str = ""
) -> Check:
    """Logits [B, T, V] against the reference's (or the implementation's own full forward's) at every
    position. prompt_len: for a cached run, where the prefill ends (positions from it on are steps 1, 2, ...)."""
    difference = np.abs(logits.astype(np.float64) - reference.astype(np.float64)).max(axis=-1)  # [B, T]
    difference = np.nan_to_num(difference, nan=0.0)  # a position step did not return (NaN) is not compared
    largest = float(difference.max())
    step_of = (lambda t: 0 if t < prompt_len else t - prompt_len + 1) if prompt_len else (lambda t: None)
    suffix = f" {against}" if against else ""
    if largest > tolerance:
        rows, cols = np.nonzero(difference > tolerance)
        t = int(cols.min())
        b = int(rows[cols == t][0])
        detail, at = f"max |logit diff| {largest:.2g}{suffix}", "first at " + where(step_of(t), b, t)
        return Check(name, FAIL, detail, at, largest, step_of(t), b, t)
    b, t = (int(i) for i in np.unravel_index(int(difference.argmax()), difference.shape))
    if largest == 0:
        return Check(name, PASS, "identical logits" + suffix, "", 0.0)
    check = Check(name, NOISE, f"max |logit diff| {largest:.1e}{suffix}", "peak at " + where(step_of(t), b, t), largest)
    known = ~np.isnan(logits).any(axis=-1)  # [B, T]
    parted = np.argwhere((logits.argmax(-1) != reference.argmax(-1)) & known)  # [K, 2]: noise at a near-tie
    if len(parted):
        b, t = (int(i) for i in parted[0])
        check.reference_margin = top2_margin(reference[b, t])
        check.detail += f"; argmax parts at a near-tie (reference margin {check.reference_margin:.1e})"
    return check


def compare_generated(
    name: str, reference: np.ndarray, ref_logits: np.ndarray, tokens: np.ndarray, P: int, near_tie: float = NEAR_TIE
) -> Check:
    """Generated tokens [B, P + n] against the reference's; where they part at a reference margin
    below near_tie (float noise's, or a 16-bit dtype's), that is noise."""
    agreement = compare_tokens(reference, tokens, P, ref_logits)
    n = reference.shape[1] - P
    if agreement.agree:
        return Check(name, PASS, f"{n} of {n} tokens equal")
    step, row = agreement.first_divergent_step, agreement.divergent_row
    assert step is not None and row is not None and agreement.reference_margin is not None
    margin = agreement.reference_margin
    tie = agreement.explained or margin < near_tie
    status = NOISE if tie else FAIL
    detail = f"tokens part at step {step}: reference margin {margin:.1e}" + (
        f" (a near-tie, below {max(near_tie, NEAR_TIE):.2g})" if tie else ""
    )
    return Check(name, status, detail, where(step, row, P + step), None, step, row, P + step, margin)


def runs(config: ModelConfig, dtype: str, quick: bool) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """The full forwards (batch, T) and cached runs (batch, prompt P, steps N) at a dtype; --quick
    drops the longest of each (and float64 altogether, in Checker.run)."""
    M = config.max_seq_len
    if dtype == "float64":
        return [(1, M)], [(1, 5, 15)]
    fulls, cacheds = [(1, 1), (1, 5), (1, M), (3, 16)], [(1, 1, 15), (1, 5, 15), (1, M - 8, 8), (3, 7, 9)]
    if quick:
        return [run for run in fulls if run[1] != M], [run for run in cacheds if run[1] != M - 8]
    return fulls, cacheds


class FailedRun:
    """A cached run whose logits differ from the implementation's own full forward: its inputs, for the variants."""

    def __init__(self, check: Check, tokens: np.ndarray, chunks: list[int], logits: np.ndarray, tolerance: float):
        self.check, self.tokens, self.chunks, self.logits, self.tolerance = check, tokens, chunks, logits, tolerance


class Checker:
    def __init__(self, implementation: Implementation, family: str, label: str, quick: bool = False):
        self.impl, self.family, self.quick = implementation, family, quick
        use_torch = implementation.framework == "torch" and registry.available_port("torch") is not None
        self.framework = "torch" if use_torch else "numpy"
        self.config, self.weights = family_weights(family)
        self.report = Report(label, implementation.kind, family, f"kvports {self.framework} port")
        self.references: dict[str, loading.LoadedModel] = {}
        self.failed_runs: list[FailedRun] = []  # cached runs that differ from the implementation's own full forward
        self.failed_tokens: list[tuple[Check, np.ndarray, np.ndarray]] = []  # generate_cached FAILs
        self.raised_at: set[tuple[str, str, str]] = set()  # (function, file:line, exception type) explained
        self.explained: set[str] = set()  # checks whose failure has its own line (an exception)
        self.batches_taken: set[int] = set()  # batch sizes the full forward took

    # -- the reference ---------------------------------------------------------------------
    def reference(self, dtype: str) -> loading.LoadedModel:
        """The reference port's model at `dtype`, loaded once by the run layer (on the CPU)."""
        if dtype not in self.references:
            weights = self.weights if dtype == "float32" else family_weights(self.family, dtype)[1]
            self.references[dtype] = loading.load_model(self.framework, self.config, weights, dtype, "cpu")
        return self.references[dtype]

    def forward(self, dtype: str, tokens: np.ndarray) -> np.ndarray:
        """The reference's logits [B, T, V] for tokens [B, T], in one chunk."""
        reference = self.reference(dtype)
        return reference.port.forward_chunks(reference.model, tokens, [tokens.shape[1]])

    def add(self, check: Check) -> Check:
        self.report.checks.append(check)
        return check

    def raised(self, name: str, error: ImplementationError, diagnosis: str | None = None) -> None:
        line = error.line
        self.explained.add(name)
        seen = (error.function, line, error.kind)
        check = Check(name, FAIL, f"raised {error.kind}", error.function + (f" ({line})" if line else ""))
        check.diagnosis = diagnosis
        self.add(check)
        if seen in self.raised_at and diagnosis is None:  # the same slip again, from another check
            return
        self.raised_at.add(seen)
        self.explain(
            diagnosis,
            (f"{diagnosis}: " if diagnosis else "")
            + f"{error.function} raised {error.kind} ({name}"
            + (f", {line}" if line else "")
            + f"): {str(error).split(': ', 1)[-1][:200]}; hint: "
            + (variants.FIXES[diagnosis] if diagnosis else error.hint()),
        )

    def explain(self, diagnosis: str | None, line: str) -> None:
        """One line per diagnosis (the first evidence found for it) or per failure nothing explains."""
        if diagnosis is not None and diagnosis in self.report.diagnoses:
            return
        if diagnosis is not None:
            self.report.diagnoses.append(diagnosis)
        self.report.explanations.append(line)

    # -- the checks ------------------------------------------------------------------------
    def run(self) -> Report:
        impl = self.impl
        model = impl.build(self.config, self.weights, "float32")
        prompt = SEED_PROMPT if self.family == "seed" else random_tokens(self.config, 1, 5, 1)
        impl.full(model, prompt)  # a plug-in whose first forward fails, misshapes or gives NaN is unusable
        if impl.can_step(model):
            impl.cached(model, prompt, [prompt.shape[1]])  # and the same for its first cached call
        self.generators(model, prompt)
        self.eval_mode(model)
        self.prefill(model)
        self.logits(model, "float32")
        if not self.quick:
            self.logits(None, "float64")
        if impl.last_only:
            self.report.notes.append(
                "step returned only the last position's logits for a prompt of several tokens: the prompt's other "
                "positions are not compared (return logits [B, T, V] for every position to have them checked)"
            )
        low = impl.logits_dtype
        if low:
            self.report.notes.append(
                f"the implementation returns {low} logits: every logit row is held at {low}'s precision "
                f"({LOW_PRECISION_TOLERANCE[low]:g} of the largest logit), not float32's; that is its dtype, "
                "not a mistake (load the weights as float32 for the tighter check)"
            )
        self.diagnose()
        return self.report

    def generators(self, model: Any, prompt: np.ndarray) -> None:
        n = GOLDEN_TOKENS if self.family == "seed" else 16
        inputs = generating.RunInputs(self.framework, "cached", GenerationConfig(n))
        result = generating.generate(self.reference("float32"), prompt, inputs, return_logits=True)
        reference, ref_logits = result.padded, result.logits
        assert reference is not None and ref_logits is not None
        what = "golden tokens" if self.family == "seed" else "greedy tokens"
        self.training_after: list[str] = []
        for mode in self.impl.generators():
            name = f"{what}, {'generate_' + mode if self.impl.kind == 'post' else mode}"
            try:
                tokens = self.impl.generate(model, prompt, n, mode)
            except ImplementationError as error:
                self.raised(name, error)
                continue
            near_tie = self.tolerance("float32", ref_logits) if self.impl.logits_dtype else NEAR_TIE
            check = self.add(compare_generated(name, reference, ref_logits, tokens, prompt.shape[1], near_tie))
            if check.status == FAIL and mode == "cached":
                self.failed_tokens.append((check, prompt, tokens))
            if self.impl.training(model):
                self.training_after.append(f"generate_{mode}" if self.impl.kind == "post" else mode)

    def eval_mode(self, model: Any) -> None:
        tokens = random_tokens(self.config, 1, 12, 2)
        try:
            first, second = self.impl.full(model, tokens), self.impl.full(model, tokens)
        except ImplementationError as error:
            return self.raised("eval mode: two runs agree", error)
        differ = float(np.abs(first - second).max())
        if self.training_after or differ > 0:
            evidence = f"model.training is True after {', '.join(self.training_after)}; " if self.training_after else ""
            evidence += f"two runs of the same forward differ by {differ:.2g}"
            self.add(Check("eval mode: two runs agree", FAIL, evidence, "", differ, diagnosis="eval_mode"))
            self.explain("eval_mode", f"eval_mode: dropout is active ({evidence}): {variants.FIXES['eval_mode']}")
            self.impl.to_eval(model)  # the post's model: the remaining checks run in eval mode, to find more
        else:
            self.add(Check("eval mode: two runs agree", PASS, "identical, dropout off"))

    def prefill(self, model: Any) -> None:
        name = "prefill: one forward for the prompt"
        prompt = random_tokens(self.config, 1, 16, 3)
        try:
            function, calls = self.impl.prefill(model, prompt)
        except ImplementationError as error:
            return self.raised(name, error)
        if calls is None:
            self.add(Check(name, SKIP, "the model's forward calls cannot be seen from outside (no forward method)"))
            return
        seen, ended = 0, None
        for count, (shape, end) in enumerate(calls, 1):
            seen += shape[1] if len(shape) > 1 else 1
            if seen >= prompt.shape[1]:
                ended = count, end
                break
        if not calls or ended is None:
            self.add(Check(name, SKIP, f"{function} made {len(calls)} forward call(s), fewer than the prompt needs"))
            return
        forwards, seconds = ended
        detail = f"{forwards} forward(s) before the first token, the first {list(calls[0][0])}; {seconds * 1e3:.1f} ms"
        if forwards == 1:
            self.add(Check(name, PASS, detail))
            return
        self.add(Check(name, FAIL, detail, f"{function}, prompt of {prompt.shape[1]}", diagnosis="prefill"))
        self.explain(
            "prefill",
            f"prefill: {function} fed the 16-token prompt in {forwards} forwards of {list(calls[0][0])}: "
            + variants.FIXES["prefill"],
        )

    def tolerance(self, dtype: str, reference: np.ndarray) -> float:
        low = self.impl.logits_dtype
        if low:
            return LOW_PRECISION_TOLERANCE[low] * max(1.0, float(np.abs(reference).max()))
        return TOLERANCE[dtype]

    def compare(
        self, name: str, reference: np.ndarray, logits: np.ndarray, dtype: str, P: int | None, against: str = ""
    ) -> Check:
        """A row at the dtype's tolerance; in float64, a difference of float32's size where every
        float32 row passes is the implementation computing in float32 inside (noise-f32), not a defect."""
        check = compare_logits(name, reference, logits, self.tolerance(dtype, reference), P, against)
        float32_rows = [c for c in self.report.checks if "float32" in c.name]
        float32_clean = bool(float32_rows) and all(c.status in (PASS, NOISE, SKIP) for c in float32_rows)
        assert check.max_abs_diff is not None
        if dtype == "float64" and check.status == FAIL and check.max_abs_diff <= TOLERANCE["float32"] and float32_clean:
            check.status = NOISE_F32
            check.detail += (
                f"; computes in float32 inside ({FLOAT32_PARTS[self.family]}): float32's noise, not a defect"
            )
        return check

    def float64_model(self) -> Any:
        """The implementation built on float64 weights, or None (a skip row says why)."""
        try:
            model = self.impl.build(self.config, family_weights(self.family, "float64")[1], "float64")
            probe = self.impl.full(model, random_tokens(self.config, 1, 3, 0))
        except (ImplementationError, UserError) as error:
            self.add(Check("float64", SKIP, f"does not take float64 weights ({str(error)[:80]})"))
            return None
        if probe.dtype != np.float64:
            self.add(Check("float64", SKIP, f"float64 weights give {probe.dtype} logits"))
            return None
        self.impl.to_eval(model)
        return model

    def logits(self, model: Any, dtype: str) -> None:
        """Full forwards against the reference (the architecture), and cached runs against the
        implementation's own full forward on the same tokens, teacher-forced (the cache itself)."""
        config = self.config
        if dtype == "float64":
            model = self.float64_model()
            if model is None:
                return
        fulls, cacheds = runs(config, dtype, self.quick)
        for batch, T in fulls:
            tokens = random_tokens(config, batch, T, 10 + T)
            name = f"full logits {dtype}, T={T}" + (f", batch {batch}" if batch > 1 else "")
            try:
                logits = self.impl.full(model, tokens)
            except (ImplementationError, UserError) as error:
                self.skip_or_fail(name, batch, error)
                continue
            self.batches_taken.add(batch)
            self.add(self.compare(name, self.forward(dtype, tokens), logits, dtype, None))
        for batch, P, N in cacheds:
            name = f"cached == full {dtype}, P={P} + {N} steps" + (f", batch {batch}" if batch > 1 else "")
            if not self.impl.can_step(model):
                self.add(Check(name, SKIP, "forward(idx) takes no caches: checked through generate_cached only"))
                continue
            tokens, chunks = random_tokens(config, batch, P + N, 20 + P), [P] + [1] * N
            try:
                logits = self.impl.cached(model, tokens, chunks)
                own = self.impl.full(model, tokens)
            except (ImplementationError, UserError) as error:
                self.skip_or_fail(name, batch, error)
                continue
            check = self.add(self.compare(name, own, logits, dtype, P, "from its own full forward"))
            if check.status == FAIL:
                self.failed_runs.append(FailedRun(check, tokens, chunks, logits, self.tolerance(dtype, own)))

    def skip_or_fail(self, name: str, batch: int, error: Exception) -> None:
        if batch > 1 and (batch not in self.batches_taken or name.startswith("full")):
            self.add(Check(name, SKIP, f"batch {batch} not taken: {str(error)[:100]}"))
        elif isinstance(error, ImplementationError):
            broke = "cached" in name and error.after_first_chunk and error.cache_like
            self.raised(name, error, "cache_update" if broke else None)
        else:
            self.add(Check(name, FAIL, str(error)[:120]))
            self.explained.add(name)
            self.explain(None, f"{name}: {error}")

    # -- diagnosis -------------------------------------------------------------------------
    def diagnose(self) -> None:
        """A known mistake is named only where its broken reference reproduces every failing cached
        run; what no mistake reproduces is listed as such, each run on its own line."""
        if "eval_mode" in self.report.diagnoses and self.impl.kind != "post":
            for check in self.report.checks:  # dropout noise matches no variant, and explains every failure
                if failing(check) and check.diagnosis is None and check.name not in self.explained:
                    check.diagnosis = "eval_mode"
            return  # the post's model was put in eval mode instead, and its checks go on
        if self.failed_runs:
            self.match_runs()
        elif self.failed_tokens and not self.report.diagnoses:
            for check, prompt, tokens in self.failed_tokens:
                self.match_tokens(check, prompt, tokens)
        named = [name for name in self.report.diagnoses if name not in ("prefill", "eval_mode")]
        unexplained = [
            check
            for check in self.report.checks
            if failing(check) and check.diagnosis is None and check.name not in self.explained
        ]
        architecture = [check for check in unexplained if check.name.startswith("full logits")]
        if architecture:
            first = architecture[0]
            self.explain(
                None,
                f"architecture: {first.name} differs from the reference ({first.detail}, {first.where}) with no cache "
                f"involved: not a cache mistake; compare the {self.family} model's parts: {FAMILY_PARTS[self.family]}"
                + (f" ({len(architecture) - 1} more full-forward run(s) differ too)" if len(architecture) > 1 else ""),
            )
        for check in unexplained:
            if check in architecture:
                continue
            if "tokens" in check.name and "eval_mode" in self.report.diagnoses:
                check.diagnosis = "eval_mode"  # dropout: the tokens part where its noise tips an argmax
                continue
            if "tokens" in check.name and (architecture or (named and check.name.endswith("cached"))):
                check.diagnosis = named[0] if named and not architecture else None
                continue  # the generated tokens follow from the architecture, or from the cache's mistake
            self.explain(None, f"{check.name}: {check.detail} ({check.where}); no known mistake reproduces it")

    def match_runs(self) -> None:
        """The first mistake whose broken reference reproduces every failing cached run, if one does."""
        complete: list[tuple[variants.Mistake, float]] = []
        for mistake in variants.MISTAKES:
            worst = 0.0
            for failed in self.failed_runs:
                distance = self.distance(mistake, failed)
                if distance is None:
                    break
                worst = max(worst, distance)
            else:
                complete.append((mistake, worst))
        names = list(dict.fromkeys(mistake.diagnosis for mistake, _ in complete))
        runs_named = "; ".join(failed.check.name.removeprefix("cached == full ") for failed in self.failed_runs)
        if len(names) > 1:  # these runs cannot tell the mistakes apart: name none
            for failed in self.failed_runs:
                self.explained.add(failed.check.name)
            self.explain(
                None,
                f"cached runs ({runs_named}) differ from the full forward as {' and as '.join(names)} would: "
                f"these runs cannot tell them apart, so neither is named ({complete[0][0].what}?)",
            )
            return
        if not complete:
            return
        mistake, distance = complete[0]
        for failed in self.failed_runs:
            failed.check.diagnosis = mistake.diagnosis
        first = self.failed_runs[0].check
        self.explain(
            mistake.diagnosis,
            f"{mistake.diagnosis}: {mistake.what} (its broken reference reproduces every failing cached run, "
            f"{runs_named}, within {distance:.1e}; first at {first.where.removeprefix('first at ')}): {mistake.fix}",
        )

    def distance(self, mistake: variants.Mistake, failed: FailedRun) -> float | None:
        """How far the mistake's broken reference is from this run's cached logits; None: too far."""
        variant = variants.forward_chunks(self.config, self.weights, failed.tokens, failed.chunks, mistake)
        distance = float(np.nanmax(np.abs(variant - failed.logits)))
        scale = max(1.0, float(np.nanmax(np.abs(failed.logits))))
        return distance if distance <= max(MATCH * scale, failed.tolerance) else None

    def match_tokens(self, check: Check, prompt: np.ndarray, tokens: np.ndarray) -> None:
        n = tokens.shape[1] - prompt.shape[1]
        for mistake in variants.MISTAKES:
            expected, logits = variants.greedy_cached(self.config, self.weights, prompt, n, mistake)
            if compare_tokens(expected, tokens, prompt.shape[1], logits).explained:
                check.diagnosis = mistake.diagnosis
                self.explain(
                    mistake.diagnosis,
                    f"{mistake.diagnosis}: {mistake.what} (its broken reference gives the same tokens as "
                    f"{check.name}): {mistake.fix}",
                )
                return


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Whatever runs inside writes to stderr, from Python (sys.stdout) or native code (file descriptor 1):
    stdout stays the report's."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1 to move: Python's own redirect is all there is
        with contextlib.redirect_stdout(sys.stderr):
            yield
        return
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_check(target: str | ModuleType, family: str = "seed", quick: bool = False) -> Report:
    """Every check on an implementation (a file path, a module name or a module), in this process:
    the report. UserError where the plug-in cannot be used at all. isolate.py runs the
    implementation in a child process instead, where an exit, a crash or a hang cannot take the
    checker down with it, nor anything it does reach the checks."""
    refuse_family(family)
    with stdout_to_stderr():
        implementation = Implementation(load_implementation(target))
        label = target if isinstance(target, str) else target.__name__
        return checked(checker_for(implementation, family, label, quick))


def refuse_family(family: str) -> None:
    if family not in FAMILIES:
        raise UserError(f"--family {family!r} is not one of {', '.join(FAMILIES)}")


def checker_for(implementation: Implementation, family: str, label: str, quick: bool) -> Checker:
    if implementation.kind == "post" and family != "seed":
        raise UserError(f"the post's interface (TinyModel) runs the seed's model only, not --family {family}")
    return Checker(implementation, family, label, quick)


def checked(checker: Checker) -> Report:
    """The checker's report; UserError where the implementation cannot be used (building its model,
    or its first forward on the seed's prompt, fails)."""
    try:
        return checker.run()
    except ImplementationError as error:
        raise UserError(f"{error} ({error.line}); hint: {error.hint()}" if error.line else str(error)) from None
