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

import time
from types import ModuleType
from typing import Any

import numpy as np

from kvports import registry, run
from kvports.agreement import NEAR_TIE, compare_tokens, top2_margin
from kvports.checker import variants
from kvports.checker.plugin import Implementation, ImplementationError, load_implementation
from kvports.checker.report import FAIL, NOISE, PASS, SKIP, Check, Report
from kvports.formats.weights import gpt2_init_weights, load_weights
from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError
from kvports.shared.generation import GenerationConfig

FAMILIES = ("seed", "gpt2", "llama", "mistral")
SEED_PROMPT = np.array([[160, 248, 104, 209, 394]], dtype=np.int64)  # [1, 5]: the seed's demo prompt
GOLDEN_TOKENS = 100  # the seed's README generates 100 tokens; tests/helpers/models.py GOLDEN holds them
TOLERANCE = {"float32": 1e-4, "float64": 1e-10}  # |logit diff| float noise may reach (float32 ports sit near 1e-6)
MATCH = 1e-3  # a broken variant whose logits are this close to the implementation's is its signature
_LLAMA = dict(positions="rope", norm="rmsnorm", activation="swiglu", attn_bias=False, ffn_bias=False)
SMALL = dict(vocab_size=64, d_model=32, n_heads=4, n_layers=2, max_seq_len=48)
# The other families at a test's size: tied GPT-2, GQA Llama, Mistral with a window of 4.
FAMILY_CONFIGS = {
    "gpt2": ModelConfig(**SMALL, activation="gelu_tanh", tie_embeddings=True),  # type: ignore[arg-type]
    "llama": ModelConfig(**SMALL, **_LLAMA, n_kv_heads=2),  # type: ignore[arg-type]
    "mistral": ModelConfig(**SMALL, **_LLAMA, n_kv_heads=2, sliding_window=4, tie_embeddings=True),  # type: ignore[arg-type]
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


def compare_logits(name: str, reference: np.ndarray, logits: np.ndarray, dtype: str, prompt_len: int | None) -> Check:
    """Logits [B, T, V] against the reference's at every position. prompt_len: for a cached run,
    where the prefill ends (positions from it on are steps 1, 2, ...)."""
    difference = np.abs(logits.astype(np.float64) - reference.astype(np.float64)).max(axis=-1)  # [B, T]
    largest = float(difference.max())
    step_of = (lambda t: 0 if t < prompt_len else t - prompt_len + 1) if prompt_len else (lambda t: None)
    if largest > TOLERANCE[dtype]:
        rows, cols = np.nonzero(difference > TOLERANCE[dtype])
        t = int(cols.min())
        b = int(rows[cols == t][0])
        detail, at = f"max |logit diff| {largest:.2g}", "first at " + where(step_of(t), b, t)
        return Check(name, FAIL, detail, at, largest, step_of(t), b, t)
    b, t = (int(i) for i in np.unravel_index(int(difference.argmax()), difference.shape))
    if largest == 0:
        return Check(name, PASS, "identical logits", "", 0.0)
    check = Check(name, NOISE, f"max |logit diff| {largest:.1e}", "peak at " + where(step_of(t), b, t), largest)
    parted = np.argwhere(logits.argmax(-1) != reference.argmax(-1))  # [K, 2]: float noise at a near-tie
    if len(parted):
        b, t = (int(i) for i in parted[0])
        check.reference_margin = top2_margin(reference[b, t])
        check.detail += f"; argmax parts at a near-tie (reference margin {check.reference_margin:.1e})"
    return check


def compare_generated(name: str, reference: np.ndarray, ref_logits: np.ndarray, tokens: np.ndarray, P: int) -> Check:
    agreement = compare_tokens(reference, tokens, P, ref_logits)
    n = reference.shape[1] - P
    if agreement.agree:
        return Check(name, PASS, f"{n} of {n} tokens equal")
    step, row = agreement.first_divergent_step, agreement.divergent_row
    assert step is not None and row is not None and agreement.reference_margin is not None
    margin = agreement.reference_margin
    status = NOISE if agreement.explained else FAIL
    detail = f"tokens part at step {step}: reference margin {margin:.1e}" + (
        f" (a near-tie, below {NEAR_TIE:g})" if agreement.explained else ""
    )
    return Check(name, status, detail, where(step, row, P + step), None, step, row, P + step, margin)


class Checker:
    def __init__(self, implementation: Implementation, family: str, label: str):
        self.impl, self.family = implementation, family
        use_torch = implementation.framework == "torch" and registry.available_port("torch") is not None
        self.framework = "torch" if use_torch else "numpy"
        self.config, self.weights = family_weights(family)
        self.report = Report(label, implementation.kind, family, f"kvports {self.framework} port")
        self.references: dict[str, run.LoadedModel] = {}
        self.failed_runs: list[tuple[Check, np.ndarray, list[int], np.ndarray]] = []  # cached FAILs: inputs, logits
        self.failed_tokens: list[tuple[Check, np.ndarray, np.ndarray]] = []  # generate_cached FAILs
        self.raised_at: set[tuple[str, str, type]] = set()  # (function, file:line, exception type) explained
        self.explained: set[str] = set()  # checks whose failure has its own line (an exception)

    # -- the reference ---------------------------------------------------------------------
    def reference(self, dtype: str) -> run.LoadedModel:
        """The reference port's model at `dtype`, loaded once by the run layer (on the CPU)."""
        if dtype not in self.references:
            weights = self.weights if dtype == "float32" else family_weights(self.family, dtype)[1]
            self.references[dtype] = run.load_model(self.framework, self.config, weights, dtype, "cpu")
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
        seen = (error.function, line, type(error.error))
        if seen in self.raised_at and diagnosis is None:  # the same slip again, from another check
            self.add(Check(name, FAIL, f"raised {type(error.error).__name__}", error.function + f" ({line})"))
            return
        self.raised_at.add(seen)
        self.add(
            Check(name, FAIL, f"raised {type(error.error).__name__}", error.function + (f" ({line})" if line else ""))
        )
        self.explain(
            diagnosis,
            f"{error.function} raised {type(error.error).__name__} ({name}"
            + (f", {line}" if line else "")
            + f"): {str(error).split(': ', 1)[-1][:200]}; hint: {error.hint()}",
        )

    def explain(self, diagnosis: str | None, line: str) -> None:
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
        self.logits(None, "float64")
        self.diagnose()
        return self.report

    def generators(self, model: Any, prompt: np.ndarray) -> None:
        n = GOLDEN_TOKENS if self.family == "seed" else 16
        inputs = run.RunInputs(self.framework, "cached", GenerationConfig(n))
        result = run.generate(self.reference("float32"), prompt, inputs, return_logits=True)
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
            check = self.add(compare_generated(name, reference, ref_logits, tokens, prompt.shape[1]))
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
        start = time.perf_counter()
        try:
            with self.impl.counting_forwards(model) as calls:
                function = self.impl.prefill_call(model, prompt)
        except ImplementationError as error:
            return self.raised(name, error)
        if calls is None:
            self.add(Check(name, SKIP, "the model's forward calls cannot be seen from outside (no forward method)"))
            return
        seen, ended = 0, None
        for count, (shape, end) in enumerate(calls, 1):
            seen += shape[1] if len(shape) > 1 else 1
            if seen >= prompt.shape[1]:
                ended = count, end - start
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

    def logits(self, model: Any, dtype: str) -> None:
        config = self.config
        M = config.max_seq_len
        if dtype == "float64":
            try:
                model = self.impl.build(config, family_weights(self.family, dtype)[1], dtype)
                probe = self.impl.full(model, random_tokens(config, 1, 3, 0))
            except (ImplementationError, UserError) as error:
                self.add(Check("float64", SKIP, f"does not take float64 weights ({str(error)[:80]})"))
                return
            if probe.dtype != np.float64:
                self.add(Check("float64", SKIP, f"float64 weights give {probe.dtype} logits"))
                return
            self.impl.to_eval(model)
            fulls, cacheds = [(1, M)], [(1, 5, 15)]
        else:
            fulls, cacheds = [(1, 1), (1, 5), (1, M), (3, 16)], [(1, 1, 15), (1, 5, 15), (1, M - 8, 8), (3, 7, 9)]
        for batch, T in fulls:
            tokens = random_tokens(config, batch, T, 10 + T)
            name = f"full logits {dtype}, T={T}" + (f", batch {batch}" if batch > 1 else "")
            try:
                logits = self.impl.full(model, tokens)
            except (ImplementationError, UserError) as error:
                self.skip_or_fail(name, batch, error)
                continue
            self.add(compare_logits(name, self.forward(dtype, tokens), logits, dtype, None))
        for batch, P, N in cacheds:
            name = f"cached == full {dtype}, P={P} + {N} steps" + (f", batch {batch}" if batch > 1 else "")
            if not self.impl.can_step(model):
                self.add(Check(name, SKIP, "forward(idx) takes no caches: checked through generate_cached only"))
                continue
            tokens, chunks = random_tokens(config, batch, P + N, 20 + P), [P] + [1] * N
            try:
                logits = self.impl.cached(model, tokens, chunks)
            except (ImplementationError, UserError) as error:
                self.skip_or_fail(name, batch, error)
                continue
            check = self.add(compare_logits(name, self.forward(dtype, tokens), logits, dtype, P))
            if check.status == FAIL:
                self.failed_runs.append((check, tokens, chunks, logits))

    def skip_or_fail(self, name: str, batch: int, error: Exception) -> None:
        if batch > 1:  # batch > 1 is checked where the implementation takes it
            self.add(Check(name, SKIP, f"batch {batch} not taken: {str(error)[:100]}"))
        elif isinstance(error, ImplementationError):
            self.raised(name, error, "cache_update" if "cached" in name and later_chunk(error) else None)
        else:
            self.add(Check(name, FAIL, str(error)[:120]))
            self.explained.add(name)
            self.explain(None, f"{name}: {error}")

    # -- diagnosis -------------------------------------------------------------------------
    def diagnose(self) -> None:
        """Each failing cached run, matched against the broken variants on its own inputs."""
        if "eval_mode" in self.report.diagnoses and self.impl.kind != "post":
            return  # dropout noise matches no variant; the post's model was put in eval mode instead
        found: list[variants.Mistake] = []  # a later run is tried against what an earlier one matched first
        for check, tokens, chunks, logits in self.failed_runs:
            mistake = self.match(check, tokens, chunks, logits, found or variants.MISTAKES)
            if mistake is not None and mistake not in found:
                found.append(mistake)
        for check, prompt, tokens in self.failed_tokens:
            if check.diagnosis is None and not self.report.diagnoses:
                self.match_tokens(check, prompt, tokens)
        unexplained = [
            check
            for check in self.report.checks
            if check.status == FAIL and check.diagnosis is None and check.name not in self.explained
        ]
        if self.report.diagnoses or not unexplained:
            return  # a diagnosis accounts for the failures (an exception's line, for its own)
        check = unexplained[0]
        more = f"; {len(unexplained) - 1} other check(s) fail too" if len(unexplained) > 1 else ""
        if "full logits" in check.name:
            self.explain(
                None,
                f"{check.name} differs from the reference ({check.detail}, {check.where}) with no cache involved: "
                f"not a cache mistake; compare the architecture with the seed's (GELU, LayerNorm, head, q/k/v order)"
                + more,
            )
        else:
            self.explain(None, f"{check.name}: {check.detail} ({check.where}); no known mistake reproduces it" + more)

    def match(
        self, check: Check, tokens: np.ndarray, chunks: list[int], logits: np.ndarray, candidates: Any
    ) -> variants.Mistake | None:
        """The first of the candidate mistakes whose broken reference reproduces these logits."""
        scale = max(1.0, float(np.abs(logits).max()))
        for mistake in candidates:
            variant = variants.forward_chunks(self.config, self.weights, tokens, chunks, mistake)
            distance = float(np.abs(variant - logits).max())
            if distance <= MATCH * scale:
                check.diagnosis = mistake.diagnosis
                self.explain(
                    mistake.diagnosis,
                    f"{mistake.diagnosis}: {mistake.what} (its broken reference reproduces {check.name} within "
                    f"{distance:.1e}, {check.where}): {mistake.fix}",
                )
                return mistake
        return None

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


def later_chunk(error: ImplementationError) -> bool:
    return error.after_first_chunk


def run_check(target: str | ModuleType, family: str = "seed") -> Report:
    """Every check on an implementation (a file path, a module name or a module): the report.
    UserError where the plug-in cannot be used at all."""
    if family not in FAMILIES:
        raise UserError(f"--family {family!r} is not one of {', '.join(FAMILIES)}")
    implementation = load_implementation(target)
    if implementation.kind == "post" and family != "seed":
        raise UserError(f"the post's interface (TinyModel) runs the seed's model only, not --family {family}")
    label = target if isinstance(target, str) else target.__name__
    checker = Checker(implementation, family, label)
    try:
        return checker.run()
    except ImplementationError as error:  # building the model, or its first forward on the seed's prompt
        raise UserError(f"{error} ({error.line}); hint: {error.hint()}" if error.line else str(error)) from None
