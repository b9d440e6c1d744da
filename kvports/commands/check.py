"""`kvports check FILE`: hold your own implementation of the seed's model to the reference,
and name the known mistake behind each defect (docs/CHECK.md)."""

from __future__ import annotations

import argparse
import json

from kvports.checker import DEFAULT_TIMEOUT, FAMILIES, run_isolated
from kvports.flags import OutOfRange, number

MAX_TIMEOUT = 86400  # seconds: a day

HELP = "check your own implementation (the post's TinyModel file, or an adapter) against the reference"
DESCRIPTION = """\
Check an implementation of the seed's model against kvports' reference: the golden tokens,
full-forward logits at every position, cached == full at every step, prompts of length 1,
a few and the maximum, a batch of 3, float32 and (where it takes them) float64 weights.
A difference within float noise is shown with its size; a real defect with the first step,
row and position where it appears, and the known mistake whose broken reference reproduces
it: position_offset, mask_offset, cache_update, prefill, eval_mode.

Two interfaces (IMPLEMENTATION is a .py file, imported without running its __main__ block,
or an importable module name):
  the post's   a torch TinyModel() whose state_dict has the seed's names, and
               generate_naive(model, prompt, n) / generate_cached(model, prompt, n):
               prompt a [1, P] int64 tensor, returning [1, P + n] tokens. Its
               forward(idx) or forward(idx, caches), caches a list of one dict per
               block that the model fills, is driven directly where it takes caches.
  an adapter   load(config: dict, weights: dict[str, numpy.ndarray]) -> model,
               full(model, tokens [B, T]) -> logits [B, T, V],
               step(model, tokens [B, T], state) -> (logits [B, T, V], state),
               state None for a new cache (that first call, with the whole prompt, is
               the prefill). Arrays in are NumPy; logits out NumPy, torch or JAX.

Weights (the seed's state_dict names; Linear weights (out, in)):
  emb.weight [V, D], pos.weight [max_seq_len, D] (learned positions only),
  blocks.{i}.ln1.{weight,bias}, blocks.{i}.qkv.{weight,bias} [(H + 2 Hkv) Dh, D]
  (q, k, v in that order), blocks.{i}.proj.{weight,bias}, blocks.{i}.ln2.*,
  blocks.{i}.ffn.0.{weight,bias} [F, D] (SwiGLU: gate then up, [2F, D]),
  blocks.{i}.ffn.2.{weight,bias} [D, F], ln.{weight,bias}, head.weight [V, D]
  (absent when the head is tied). RMSNorm families have no .bias on norms, Llama and
  Mistral none on linears. config: kvports' ModelConfig as a dict (vocab_size, d_model,
  n_heads, n_kv_heads, n_layers, max_seq_len, norm, norm_eps, positions, rope_theta,
  activation, tie_embeddings, sliding_window, ...).

Exit status: 0 every check passes, 1 a real defect (or the implementation raised during a
check), 2 an implementation that cannot be used (cannot import, a missing function, wrong
parameter names, a first forward that raises or gives the wrong shape or NaN)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("implementation", help="a .py file or a module name")
    parser.add_argument(
        "--family",
        choices=FAMILIES,
        default="seed",
        help="adapters only: seed (the shipped seed model, the default) or a small random model of that family",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="drop the longest runs (T = the maximum) and every float64 run: a faster, weaker check",
    )
    parser.add_argument(
        "--timeout",
        type=seconds,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"how long one call of the implementation may take before it is stopped (TIMEOUT); "
        f"default {DEFAULT_TIMEOUT:g}",
    )
    parser.add_argument(
        "--json", action="store_true", help='print {"ok", "checks": [...], "diagnoses": [...], "explanations", ...}'
    )


def seconds(text: str) -> float:
    """A time limit: more than 0, at most a day (a finite number: nan and inf are refused)."""
    value = number(text)
    if not 0 < value <= MAX_TIMEOUT:
        raise OutOfRange(f"{value:g} is not above 0 and at most {MAX_TIMEOUT}")
    return value


def run(args: argparse.Namespace) -> int:
    # The checks run in a child process whose stdout and stderr come back on stderr:
    # stdout is the report (and --json's one object).
    report = run_isolated(args.implementation, args.family, args.quick, args.timeout)
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        from kvports.terminal import console_for

        table = report.table()
        console = console_for(table)
        console.print(table)
        for line in report.explanations:
            console.print(f"[bold red]diagnosis[/]: {line}", highlight=False, soft_wrap=True)
        for line in report.notes:
            console.print(f"note: {line}", highlight=False, soft_wrap=True)
        print("ok: every check passes" if report.ok else "FAILED: see the diagnosis above")
    return 0 if report.ok else 1
