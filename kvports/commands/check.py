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
full-forward logits at every position against the reference (the architecture), and each
cached run against the implementation's own full forward on the same tokens (the cache):
prompts of length 1, a few and the maximum, a batch of 3, float32 and (where it takes them)
float64 weights. A difference within float noise is shown with its size; a real defect with
the first step, row and position where it appears, and the known mistake whose broken
reference reproduces every failing cached run: position_offset, mask_offset, cache_update,
prefill, eval_mode. The implementation runs in a child process: an exit, a crash or a hang
there is a verdict, and whatever it prints goes to stderr.

Two interfaces (IMPLEMENTATION is a .py file, imported without running its __main__ block,
or an importable module name):
  the post's   a torch TinyModel() whose state_dict has the seed's names, and
               generate_naive(model, prompt, n) / generate_cached(model, prompt, n):
               prompt a [1, P] int64 tensor, returning [1, P + n] tokens. Its
               forward(idx, caches) is driven directly, as the post calls it: the whole
               history with caches = [None] * len(model.blocks), the cached path with
               caches = [{} for each block], which the model fills and reads. (A second
               parameter with a default: forward(idx) for the whole history.)
  an adapter   load(config: dict, weights: dict[str, numpy.ndarray]) -> model,
               full(model, tokens [B, T]) -> logits [B, T, V],
               step(model, tokens [B, T], state) -> (logits [B, T, V], state),
               state None for a new cache (that first call, with the whole prompt, is
               the prefill). Arrays in are NumPy; logits out NumPy, torch, JAX or
               nested lists (a tuple or an object with .logits: its logits).

Weights (the seed's state_dict names; Linear weights (out, in)):
  emb.weight [V, D], pos.weight [max_seq_len, D] (learned positions only),
  blocks.{i}.ln1.{weight,bias}, blocks.{i}.qkv.{weight,bias} [(H + 2 Hkv) Dh, D]
  (q, k, v in that order), blocks.{i}.proj.{weight,bias}, blocks.{i}.ln2.*,
  blocks.{i}.ffn.0.{weight,bias} [F, D] (SwiGLU: gate then up, [2F, D]),
  blocks.{i}.ffn.2.{weight,bias} [D, F], ln.{weight,bias}, head.weight [V, D]
  (absent when the head is tied). RMSNorm families have no .bias on norms, Llama and
  Mistral none on linears; qwen2 has qkv.bias; qwen3 and gemma3 add blocks.{i}.q_norm.weight
  and k_norm.weight [Dh], gemma3 blocks.{i}.ln1_post.weight and ln2_post.weight [D] (its
  norms' (1 + w) already folded into the weight). config: kvports' ModelConfig as a dict (vocab_size, d_model,
  n_heads, n_kv_heads, n_layers, max_seq_len, norm, norm_eps, positions, rope_theta,
  activation, ffn_hidden, tie_embeddings, sliding_window, ...), with n_kv_heads and
  ffn_hidden (F) filled in.

Conventions:
  RoPE       half-split, as transformers' Llama: dimension i pairs with i + Dh/2, angle
             position * rope_theta ** (-i / (Dh/2)). An interleaved implementation (pairs
             2i, 2i+1: gpt-fast, llama2.c, Meta's) permutes each head's q and k rows:
             w.reshape(heads, 2, Dh // 2, D).transpose(0, 2, 1, 3).reshape(heads * Dh, D).
  GQA        query head h reads key/value head h // (H / Hkv).
  window     a sliding window of W attends W keys, the current token's included.
  families   seed  V 500, D 128, H 4, L 2, 512 positions, F 512, LayerNorm, exact GELU
             gpt2  V 64, D 32, H 4, L 2, 48 positions, F 128, LayerNorm, tanh GELU, tied
             gpt2-window  gpt2's, with a window of 4
             llama V 64, D 32, H 4, Hkv 2, L 2, 48 positions, F 128, RMSNorm, RoPE, SwiGLU
             mistral  llama's, tied, with a window of 4
             llama3  llama's, RoPE theta 500000 scaled (llama3: factor 8, original length 16)
             qwen2  llama's, tied, biases on q, k and v (not proj)
             qwen3  llama's, qk-norm, head size 16 (q 64 wide, proj 64 -> 32)
             gemma3  llama's, MQA, head size 16, qk-norm, post-norms, GELU(tanh)-gated MLP,
                    embeddings x sqrt(32), scale 24**-0.5, window 4 in layer 0 (RoPE base
                    10000), layer 1 global (base 1e6), tied

Rows: pass (identical), noise (within float noise, or a near-tie), noise-f32 (a float64 row
off by float32's noise while every float32 row passes: the implementation computes in float32
inside), skip, FAIL, TIMEOUT (a call that did not return within --timeout).

Exit status: 0 no row FAIL or TIMEOUT; 1 a FAIL or TIMEOUT row (a defect; a call that
raised, exited, ended the process or hung); 2 an implementation that cannot be used (cannot
import, or its import exits or hangs; a missing function, wrong parameter names, a first
forward that raises or gives the wrong shape or NaN)."""


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
    # The implementation's calls run in a child process whose stdout and stderr come back on stderr;
    # the checks and the verdict are this process's: stdout is the report (and --json's one object).
    report = run_isolated(args.implementation, args.family, args.quick, args.timeout)
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        from rich.markup import escape

        from kvports.terminal import console_for

        table = report.table()
        console = console_for(table)
        console.print(table)
        for line in report.explanations:
            console.print(f"[bold red]diagnosis[/]: {escape(line)}", highlight=False, soft_wrap=True)
        for line in report.notes:
            console.print(f"note: {escape(line)}", highlight=False, soft_wrap=True)
        print("ok: every check passes" if report.ok else "FAILED: see the diagnosis above")
    return 0 if report.ok else 1
