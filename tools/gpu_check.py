"""`make gpu-check`: on a machine with an NVIDIA GPU, one command that says whether the ports agree
there and how fast they are, as one Markdown report (docs/BENCH.md's GPU section pastes it).

Every figure comes from the kvports commands themselves, run as subprocesses with --json (each
frees its GPU memory as it exits; JAX is told not to preallocate, so torch and JAX share the GPU):

- agreement: `kvports compare --device gpu` on the seed's model and on GPT-2-small-shaped random
  weights, at float32 and float64. Every torch and JAX row must give the tokens of the CPU
  reference (`kvports compare --device cpu`, torch naive): exactly at float64; at float32 a
  divergence only at a float near-tie (compare's own rule). NumPy's rows in the GPU run are the
  CPU beside the GPU reference, logit distances and all. float32 on a GPU is IEEE float32 (no
  TF32: each port's `resolve_device`).
- fewer bits: bfloat16 and int8 (and q4 where a GGUF file with 4-bit blocks is fetched) with
  each framework that offers them, and their distance from float32. Reported; a command that
  fails is a failure.
- speed: `kvports bench --device gpu` on the gpt2-small preset and a SmolLM2-shaped random model:
  prefill (time to first token, and any prefill figures the bench's JSON has) and decode per
  port, the roofline against the bandwidth the bench measures in the same run, JAX's compiled
  loop beside torch eager and, on gpt2-small, torch.compile (CUDA graphs on a GPU).
- the tests marked `gpu` (tests/test_gpu.py).

Exit 0: every row agrees; 1: a disagreement or a step that failed (one the time limit left no
time for included); 2: no GPU here (one `error:` line naming what is missing, before anything
runs). Nothing is fetched from the network.

    python tools/gpu_check.py [--out REPORT.md] [--minutes 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout

from kvports import loading, registry  # noqa: E402
from kvports.bench.presets import PRESETS  # noqa: E402
from kvports.formats.weights import gpt2_init_weights, save_weights  # noqa: E402
from kvports.shared.config import ModelConfig  # noqa: E402
from kvports.shared.errors import UserError  # noqa: E402
from kvports.validation import SEED_PROMPT, offers  # noqa: E402

GPU_FRAMEWORKS = ("torch", "jax")  # the ports that run on a GPU; NumPy stays on the CPU
# SmolLM2-135M's shape (a Llama: GQA 9q/3kv, 30 layers, tied head), random weights: the real GGUF may not be here.
SMOLLM2_SHAPE = ModelConfig(
    vocab_size=49152,
    d_model=576,
    n_heads=9,
    n_kv_heads=3,
    n_layers=30,
    ffn_hidden=1536,
    max_seq_len=2048,
    norm="rmsnorm",
    positions="rope",
    rope_theta=100000.0,
    activation="swiglu",
    attn_bias=False,
    ffn_bias=False,
    tie_embeddings=True,
)
# The same shapes at a few thousand parameters: the pipeline end to end on the CPU (the hidden --small).
TINY = {"vocab_size": 64, "d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 64}
SMALL_SHAPES = {
    "gpt2-small-shaped": dataclasses.replace(PRESETS["gpt2-small"] or ModelConfig(), **TINY),
    "smollm2-shaped": dataclasses.replace(SMOLLM2_SHAPE, **TINY, n_kv_heads=2, ffn_hidden=None),
}
REDUCED = (("bfloat16", "none"), ("float32", "int8"))  # q4 needs a GGUF file's own 4-bit blocks
EXIT_DISAGREE = 1
TIMED_OUT = 124  # a command's status when the time limit stopped it (timeout(1)'s)
EXIT_NO_GPU = 2


@dataclass
class Plan:
    """What one run does: where (gpu; cpu for the hidden test switch), which GPU frameworks, how big."""

    device: str = "gpu"
    frameworks: tuple[str, ...] = GPU_FRAMEWORKS
    small: bool = False
    minutes: float = 8.0

    @property
    def compare_tokens(self) -> int:
        return 8 if self.small else 16

    @property
    def bench_tokens(self) -> int:
        return 8 if self.small else 64


@dataclass
class Section:
    """One part of the report: its Markdown lines and what failed in it (empty: it passed)."""

    title: str
    lines: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- running kvports


class StepFailed(Exception):
    """A kvports command that exited with an error or printed no JSON: its one-line reason, and its exit
    status (None: not run, the time limit reached)."""

    def __init__(self, reason: str, status: int | None = None):
        super().__init__(reason)
        self.status = status


Runner = Callable[[Sequence[str], float], tuple[int, str, str]]


def run_command(argv: Sequence[str], timeout: float) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of one command."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=max(timeout, 1), cwd=ROOT)
    except subprocess.TimeoutExpired:
        return TIMED_OUT, "", f"timed out after {timeout:.0f} s"
    return done.returncode, done.stdout, done.stderr


class Kvports:
    """The kvports command line as subprocesses, within the run's time limit."""

    def __init__(self, minutes: float, runner: Runner = run_command):
        self.deadline = time.monotonic() + 60 * minutes
        self.runner = runner

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, argv: Sequence[str], ok: Sequence[int] = (0,)) -> tuple[int, str, str]:
        if self.left() < 5:
            raise StepFailed("not run: the time limit was reached")
        print(f"gpu-check: {' '.join(argv)}", file=sys.stderr, flush=True)
        status, out, err = self.runner(argv, self.left())
        if status not in ok:
            raise StepFailed(why(status, err), status)
        return status, out, err

    def json(self, args: Sequence[str], ok: Sequence[int] = (0,)) -> dict[str, Any]:
        """`kvports ARGS --json`'s object; compare exits 1 on a disagreement and still prints it."""
        status, out, err = self.run([sys.executable, "-m", "kvports.cli", *args, "--json"], ok)
        try:
            return dict(json.loads(out))
        except json.JSONDecodeError:  # a crash exits 1 too
            raise StepFailed(why(status, err), status) from None


def why(status: int, err: str) -> str:
    """A failed command in one line: its exit status and the last line it printed on stderr."""
    lines = [line.strip() for line in err.splitlines() if line.strip()] or ["(nothing on stderr)"]
    return f"exit {status}: {lines[-1]}"


# ---------------------------------------------------------------- the GPU, or one line saying why not


def probe(plan: Plan) -> dict[str, Any]:
    """What runs where: the GPU's name and the frameworks' versions, or UserError naming what is missing.
    The run layer's own check (`usable_ports`), so the reasons are the ones every command gives."""
    installed = [name for name in plan.frameworks if not registry.missing_packages(name)]
    if plan.device == "gpu" and not installed:
        raise UserError(
            "make gpu-check needs torch or JAX with a GPU: neither is installed (see the README's Install section)"
        )
    try:
        ports, reasons = loading.usable_ports(installed, plan.device)
    except UserError as exc:
        raise UserError(f"make gpu-check needs a GPU: {str(exc).removeprefix('--device gpu: ')}") from None
    versions: dict[str, str] = {}
    for port in [*ports.values(), registry.load_port("numpy")]:
        versions.update(port.versions())
    return {
        "gpu": gpu_name(ports) if plan.device == "gpu" else "none (a CPU run of the check itself)",
        "versions": versions,
        "unusable": {
            name: reasons.get(name, registry.not_installed(name)) for name in plan.frameworks if name not in ports
        },
        "frameworks": tuple(ports),
    }


def gpu_name(ports: dict[str, Any]) -> str:
    if "torch" in ports:
        import torch

        return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    import jax

    return str(jax.devices("gpu")[0].device_kind)


# ---------------------------------------------------------------- models


def model_files(plan: Plan, folder: Path) -> dict[str, list[str]]:
    """Each model the check runs -> the flags that name it: the seed's shipped model, and random weights
    in GPT-2 small's and SmolLM2-135M's shapes, written to `folder` (the bench's gpt2-small is its preset)."""
    shapes = (
        SMALL_SHAPES if plan.small else {"gpt2-small-shaped": PRESETS["gpt2-small"], "smollm2-shaped": SMOLLM2_SHAPE}
    )
    models: dict[str, list[str]] = {"seed": []}
    for name, config in shapes.items():
        assert config is not None
        path = folder / f"{name}.safetensors"
        save_weights(path, gpt2_init_weights(config, seed=0), config)
        models[name] = ["--weights", str(path)]
    return models


def compare_flags(models: dict[str, list[str]], model: str) -> list[str]:
    """The model's flags for compare: a random model's prompt is the seed's, its ids wrapped into the vocabulary
    (the bench wraps its own)."""
    if model == "seed":
        return models[model]
    from kvports.formats.weights import open_weights

    with open_weights(Path(models[model][1])) as file:  # the header alone
        vocab = file.config.vocab_size
    return [*models[model], "--prompt", ",".join(str(token % vocab) for token in SEED_PROMPT)]


# ---------------------------------------------------------------- agreement


def agreement(kv: Kvports, plan: Plan, frameworks: Sequence[str], models: dict[str, list[str]]) -> Section:
    """GPU rows against the CPU reference, on the seed's and GPT-2-small-shaped weights at float32 and float64."""
    section = Section(
        "Agreement: the GPU against the CPU",
        [
            "| model | dtype | framework | mode | device | tokens | GPU reference vs CPU | max abs logit diff "
            "| seconds |",
            "|---|---|---|---|---|---|---|---|---:|",
        ],
    )
    cpu_frameworks = "torch" if "torch" in frameworks else "numpy"
    for model in ("seed", "gpt2-small-shaped"):
        for dtype in ("float32", "float64"):
            common = [
                *compare_flags(models, model),
                "--dtype",
                dtype,
                "--new-tokens",
                str(plan.compare_tokens),
                "--repeats",
                "1",
            ]
            try:
                cpu = kv.json(
                    ["compare", "--device", "cpu", "--frameworks", cpu_frameworks, "--modes", "naive", *common]
                )
                gpu = kv.json(
                    ["compare", "--device", plan.device, "--frameworks", ",".join([*frameworks, "numpy"]), *common],
                    ok=(0, 1),
                )
            except StepFailed as exc:
                section.failures.append(f"{model} {dtype}: {exc}")
                section.lines.append(f"| {model} | {dtype} | - | - | - | {exc} | - | - | - |")
                continue
            agreement_rows(section, model, dtype, cpu, gpu)
    section.lines.append("")
    section.lines.append(
        "tokens: against the GPU run's reference (torch naive on the GPU); GPU reference vs CPU: its tokens "
        "against the CPU reference's (torch naive, `--device cpu`); float64 must agree exactly, float32 may part "
        "only at a float near-tie (top-2 margin below compare's bound); max abs logit diff: against the GPU "
        "reference, up to the first divergence (NumPy's rows: the CPU against the GPU)"
    )
    return section


def agreement_rows(section: Section, model: str, dtype: str, cpu: dict[str, Any], gpu: dict[str, Any]) -> None:
    """One compare run's rows; a row that is not token-equal (float64), or not explained (float32), fails."""
    same_as_cpu = gpu["tokens"] == cpu["tokens"]
    cpu_rows = [row for row in gpu["rows"] if row["available"] and row["device"] == "cpu"]
    # float32: the GPU reference may part from the CPU's at a near-tie, which the CPU's own rows in this run show.
    cpu_explains = bool(cpu_rows) and all(row["explained"] for row in cpu_rows)
    for row in gpu["rows"]:
        where = f"{model} {dtype} {row['framework']} {row['mode']} ({row['device']})"
        if not row["available"]:
            section.lines.append(
                f"| {model} | {dtype} | {row['framework']} | {row['mode']} | {row['device']} | "
                f"not run: {row['reason']} | - | - | - |"
            )
            continue
        tokens = tokens_word(row)
        versus_cpu = (
            "equal" if same_as_cpu else "DIFFER" + (" (near-tie)" if dtype == "float32" and cpu_explains else "")
        )
        exact = row["agree"] and same_as_cpu
        passed = exact if dtype == "float64" else row["explained"] and (same_as_cpu or cpu_explains)
        if not passed:
            section.failures.append(f"{where}: tokens {tokens}, GPU reference vs CPU {versus_cpu}")
        logits = row.get("logits")
        diff = "-" if not logits else f"{logits['max_abs_diff']:.1e}"
        section.lines.append(
            f"| {model} | {dtype} | {row['framework']} | {row['mode']} | {row['device']} | {tokens} | {versus_cpu} | "
            f"{diff} | {row['seconds']:.3f} |"
        )


def tokens_word(row: dict[str, Any]) -> str:
    if row["agree"]:
        return "agree"
    return f"{'near-tie' if row['explained'] else 'DIFFER'} @ {row['first_divergent_step']}"


# ---------------------------------------------------------------- fewer bits


def reduced_precision(
    kv: Kvports, plan: Plan, frameworks: Sequence[str], models: dict[str, list[str]], q4_model: list[str] | None
) -> Section:
    """bfloat16, int8 (and q4 on a GGUF file's own blocks) on the GPU, with their distance from float32."""
    section = Section(
        "Fewer bits on the GPU: distance from float32",
        [
            "| model | weights | framework | mode | tokens vs float32 | max abs logit diff vs float32 |",
            "|---|---|---|---|---|---|",
        ],
    )
    runs = [(model, dtype, quant) for model in ("seed", "gpt2-small-shaped") for dtype, quant in REDUCED]
    if q4_model is not None:
        runs.append(("smollm2 (GGUF)", "float32", "q4"))
    else:
        section.lines.append("| smollm2 (GGUF) | float32+q4 | - | - | not run: `kvports fetch smollm2` first | - |")
    for model, dtype, quant in runs:
        weights = dtype if quant == "none" else f"{dtype}+{quant}"
        chosen = [name for name in frameworks if offers(name, dtype, quant)]
        if not chosen:
            section.lines.append(
                f"| {model} | {weights} | - | - | not offered by {', '.join(frameworks) or 'the frameworks here'} | - |"
            )
            continue
        flags = q4_model if model == "smollm2 (GGUF)" else compare_flags(models, model)
        assert flags is not None
        args = ["--device", plan.device, "--dtype", dtype, "--quant", quant, "--new-tokens", str(plan.compare_tokens)]
        args += ["--modes", "cached", "--repeats", "1", *flags]  # the distance needs one mode
        # Rows in fewer bits may part from each other: reported, not failed. Where the run fails (not for time),
        # each framework again alone: the one that fails is named, the others' rows still shown.
        rows: list[dict[str, Any]] = []
        try:
            rows = kv.json(["compare", "--frameworks", ",".join(chosen), *args], ok=(0, 1))["rows"]
        except StepFailed as exc:
            alone = len(chosen) > 1 and exc.status not in (None, TIMED_OUT)
            failed = [] if alone else [(",".join(chosen), exc)]
            for name in chosen if alone else []:
                try:
                    rows += kv.json(["compare", "--frameworks", name, *args], ok=(0, 1))["rows"]
                except StepFailed as exc_alone:
                    failed.append((name, exc_alone))
            for names, reason in failed:
                section.failures.append(f"{model} {weights} {names}: {reason}")
                section.lines.append(f"| {model} | {weights} | {names} | - | {reason} | - |")
        for row in rows:
            if not row["available"]:
                section.lines.append(
                    f"| {model} | {weights} | {row['framework']} | {row['mode']} | not run: {row['reason']} | - |"
                )
                continue
            figures = row.get("vs_float32") or {}
            step = figures.get("first_divergent_step")
            diff = figures.get("max_abs_diff")
            section.lines.append(
                f"| {model} | {weights} | {row['framework']} | {row['mode']} | "
                f"{'agree' if step is None else f'part @ {step}'} | {'-' if diff is None else f'{diff:.1e}'} |"
            )
    section.lines.append("")
    section.lines.append(
        "against the reference port's float32 run on the same weights (compare's vs float32): reported, never a "
        "failure; a command that fails is"
    )
    return section


# ---------------------------------------------------------------- speed


def prefill_fields(row: dict[str, Any]) -> list[str]:
    """The prefill figures a bench row carries besides ttft_ms: any `pp` field (`pp`, `pp_*`, `prefill_*`)."""
    return [key for key in row if key == "pp" or key.startswith(("pp_", "prefill_"))]


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def speed(kv: Kvports, plan: Plan, frameworks: Sequence[str], models: dict[str, list[str]]) -> Section:
    """`kvports bench` on the gpt2-small preset (naive and cached, torch.compile beside eager) and the
    SmolLM2-shaped model (cached: its 30 layers make compiling the costly part of the eight minutes)."""
    section = Section("Speed: kvports bench on the GPU")
    chosen = list(frameworks)
    for model, flags in (("gpt2-small", ["--preset", "gpt2-small"]), ("smollm2-shaped", models["smollm2-shaped"])):
        if plan.small and model == "gpt2-small":  # the preset's 124M parameters are not for a CPU run of the check
            model, flags = "gpt2-small-shaped", models["gpt2-small-shaped"]
        args = ["bench", "--device", plan.device, "--frameworks", ",".join(chosen), "--roofline", *flags]
        args += ["--new-tokens", str(plan.bench_tokens), "--repeats", "1" if plan.small else "3"]
        if model.startswith("smollm2"):
            args += ["--modes", "cached"]
        elif "torch" in chosen:
            args.append("--compile")  # torch.compile beside eager (on a GPU: CUDA graphs, mode reduce-overhead)
        try:
            result = kv.json(args)
        except StepFailed as exc:
            section.failures.append(f"bench {model}: {exc}")
            section.lines += [f"**{model}**: failed: {exc}", ""]
            continue
        section.lines += bench_lines(model, result)
    return section


def bench_lines(model: str, result: dict[str, Any]) -> list[str]:
    """One bench run as a table: a row per framework, variant, mode and weights."""
    settings, machine, rows = result["settings"], result["machine"], result["rows"]
    extra = list(dict.fromkeys(key for row in rows for key in prefill_fields(row)))
    lines = [
        f"**{model}**: {settings['parameters']:,} parameters, batch {settings['batch']}, "
        f"prompt {settings['prompt_len']}, "
        f"{settings['new_tokens']} new tokens, medians of {settings['repeats']}; bandwidth measured in this run: "
        + ", ".join(f"{name} {value:.0f} GB/s" for name, value in (machine.get("bandwidth_gb_s") or {}).items()),
        "",
        "| framework | mode | weights | device | ttft ms | "
        + "".join(f"{key} | " for key in extra)
        + "decode ms/token | tokens/s | roofline ms | x roofline | compile s |",
        "|---|---|---|---|---:|" + "---:|" * len(extra) + "---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        name = row["framework"] + ("" if row.get("variant") is None else f" ({row['variant']})")
        if not row["available"]:
            lines.append(
                f"| {name} | {row['mode']} | {row.get('weights') or '-'} | - | not run: {row['reason']} |"
                + " - |" * (len(extra) + 5)
            )
            continue
        cells = [fmt(row.get("ttft_ms"))] + [fmt(row.get(key)) for key in extra]
        cells += [fmt(row.get("decode_ms_per_token"), 3), fmt(row.get("tokens_per_s"), 1)]
        cells += [fmt(row.get("roofline_ms"), 3), fmt(row.get("roofline_ratio"), 1), fmt(row.get("compile_s"))]
        lines.append(f"| {name} | {row['mode']} | {row['weights']} | {row['device']} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


# ---------------------------------------------------------------- the tests marked gpu


def gpu_tests(kv: Kvports, plan: Plan) -> Section:
    """pytest -m gpu: its summary, each skip's reason (one line where there is no GPU), failures failing."""
    section = Section("Tests marked gpu")
    if importlib.util.find_spec("pytest") is None:
        section.failures.append("pytest -m gpu: pytest is not installed (pip install -e '.[gpu-check]')")
        return section
    argv = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_gpu.py"]
    try:
        status, out, _ = kv.run(argv, ok=(0, 1, 5))
    except StepFailed as exc:
        section.failures.append(f"pytest -m gpu: {exc}")
        section.lines.append(f"failed: {exc}")
        return section
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    summary = next(
        (line for line in reversed(lines) if re.search(r"\b(passed|failed|skipped|error|no tests)", line)), ""
    )
    section.lines.append(f"`pytest -m gpu tests/test_gpu.py`: {summary.strip('= ') or f'exit {status}'}")
    section.lines += [f"- {line}" for line in lines if line.startswith(("SKIPPED", "FAILED", "ERROR"))]
    if status != 0:
        section.failures.append(f"pytest -m gpu: {summary.strip('= ') or f'exit {status}'}")
    return section


# ---------------------------------------------------------------- the report


def build_report(found: dict[str, Any], sections: Sequence[Section], when: str) -> tuple[str, int]:
    """(the Markdown report, the exit status): 0 when no section has a failure."""
    versions = ", ".join(f"{name} {version}" for name, version in found["versions"].items())
    lines = [
        f"### kvports gpu-check, {when}",
        "",
        f"GPU: {found['gpu']}; {versions}",
    ]
    lines += [f"{name}: not on the GPU ({reason})" for name, reason in found["unusable"].items()]
    for section in sections:
        lines += ["", f"#### {section.title}", "", *section.lines]
    failures = [failure for section in sections for failure in section.failures]
    lines += ["", "#### Verdict", ""]
    if failures:
        lines += [f"{len(failures)} failure{'s' * (len(failures) != 1)}:", *[f"- {failure}" for failure in failures]]
    else:
        lines.append("every row agrees")
    return "\n".join(lines) + "\n", EXIT_DISAGREE if failures else 0


def q4_file() -> list[str] | None:
    """`--model smollm2` where the GGUF file (Q4_1 blocks) is fetched, else None."""
    from kvports.hub import model_path

    try:
        model_path("smollm2")
    except UserError:
        return None
    return ["--model", "smollm2"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="tools/gpu_check.py")
    parser.add_argument("--out", type=Path, default=None, help="also write the report to this file")
    parser.add_argument("--minutes", type=float, default=8.0, help="the time limit of the whole check (default 8)")
    # The test switch: the same pipeline on the CPU, the named frameworks, tiny models (tests/test_gpu.py).
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu", help=argparse.SUPPRESS)
    parser.add_argument("--frameworks", default=",".join(GPU_FRAMEWORKS), help=argparse.SUPPRESS)
    parser.add_argument("--small", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, runner: Runner = run_command) -> int:
    args = parse_args(argv)
    # JAX takes most of a GPU's memory when it starts, unless told not to: torch runs beside it, in the probe
    # here and in the commands (which inherit this); a user's own setting wins.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    frameworks = tuple(name for name in args.frameworks.split(",") if name)
    plan = Plan(args.device, frameworks, args.small, args.minutes)
    try:
        found = probe(plan)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_NO_GPU
    kv = Kvports(plan.minutes, runner)
    with tempfile.TemporaryDirectory(prefix="kvports-gpu-check-") as folder:
        models = model_files(plan, Path(folder))
        usable = found["frameworks"]
        # What matters most first, should the time limit cut the rest short; the report keeps its own order.
        agreed, tested = agreement(kv, plan, usable, models), gpu_tests(kv, plan)
        timed = speed(kv, plan, usable, models)
        sections = [agreed, reduced_precision(kv, plan, usable, models, q4_file()), timed, tested]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    report, status = build_report(found, sections, when)
    if args.out is not None:
        from kvports.shared.files import write_atomic

        write_atomic(args.out, report.encode())
    sys.stdout.write(report)
    return status


if __name__ == "__main__":
    sys.exit(main())
