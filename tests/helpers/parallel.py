"""Tensor parallelism's runs: JAX's simulated devices exist only in a process that asked for them
before JAX started, so every split is run in one subprocess with 4 CPU devices, and its tokens,
logits, partition specs and collectives come back as .npz files."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from kvports import registry
from tests.helpers.models import TINY_FAMILIES, random_weights

TP_SIZES = (1, 2, 4)
TP_CASES = {  # name -> (mode, GenerationConfig fields, with a draft model)
    "cached_greedy": ("cached", dict(max_new_tokens=6), False),
    "cached_sampled": ("cached", dict(max_new_tokens=6, temperature=0.9, top_k=20, seed=3), False),
    "speculative_sampled": ("speculative", dict(max_new_tokens=6, temperature=0.9, seed=5), True),
}


def tensor_parallel_runs(out: str, dtype: str = "float64", cases: tuple[str, ...] = tuple(TP_CASES)) -> None:
    """Every tiny family x TP_CASES x TP_SIZES through the JAX port, saved to `out` (.npz): tokens,
    step logits, and the KV cache's and a qkv kernel's partition specs. Run in a subprocess that
    asks for 4 simulated devices (`tensor_parallel_subprocess`)."""
    import jax

    from kvports.jax_impl import generate as jax_generate
    from kvports.jax_impl import port as jax_port
    from kvports.jax_impl.split import split_model
    from kvports.shared.generation import GenerationConfig

    prompts = np.array([[-1, 5, 9, 2], [7, 3, 11, 4]])  # [2, 4]: a left-padded row (PAD = -1) and a full one
    saved: dict[str, np.ndarray] = {}
    for family, config in TINY_FAMILIES.items():
        tensors = {name: array.astype(dtype) for name, array in random_weights(config).items()}
        draft_config = dataclasses.replace(config, n_layers=1)
        draft_tensors = {name: array.astype(dtype) for name, array in random_weights(draft_config, seed=1).items()}
        for n in TP_SIZES:
            model = jax_port.load_model(config, tensors, dtype, tensor_parallel=n)
            draft = jax_port.load_model(draft_config, draft_tensors, dtype, tensor_parallel=n)
            for case in cases:
                mode, fields, with_draft = TP_CASES[case]
                generation = GenerationConfig(**fields)
                key = f"{family}/{case}/{n}"
                if mode == "speculative":
                    saved[f"{key}/tokens"] = jax_port.generate_speculative(
                        model, draft if with_draft else None, prompts, generation, 3
                    )[0]
                else:
                    saved[f"{key}/tokens"], saved[f"{key}/logits"] = jax_port.generate(
                        model, prompts, generation, mode, True
                    )

            # The cache a prefill leaves, made as port.generate makes the first case's (the same
            # settings, so the program it compiled serves this call too).
            @jax_port.exact
            def prefilled_cache(model=model):
                prompt = jax.device_put(np.asarray(prompts, np.int32), jax_port._inputs_sharding(model))
                with jax.default_device(jax_port._model_device(model)):
                    generation = GenerationConfig(**TP_CASES[cases[0]][1])
                    decoding, tokens = jax_generate.start_generation(prompt, generation, model.emb.embedding.dtype)
                    state, _ = jax_generate._start_cached(*split_model(model), prompt, tokens, decoding, True, True)
                return state.cache.keys

            for name, array in (("cache", prefilled_cache()), ("qkv", model.blocks[0].qkv.kernel[...])):
                spec = getattr(array.sharding, "spec", ())
                saved[f"{key.rsplit('/', 2)[0]}/{n}/{name}_spec"] = np.array(repr(tuple(spec)))
    np.savez(out, **saved)


COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")


def tensor_parallel_collectives(out: str) -> None:
    """How many of each collective the JAX port's compiled forward holds, split across 2 and 4
    devices: a prefill (T = 5) and a decode step (T = 1) through generate.py's `_forward`, for the
    gpt2 family (biases, GELU) and llama (SwiGLU, GQA: at N = 4 its 2 key/value heads are copied),
    read from XLA's compiled program and saved to `out` (.npz) by "family/N/T/collective"."""
    import re

    import jax

    from kvports.jax_impl import generate as jax_generate
    from kvports.jax_impl.model import init_cache
    from kvports.jax_impl.split import split_model

    jax_port = registry.load_port("jax")
    counts: dict[str, np.ndarray] = {}
    for family in ("gpt2", "llama"):
        config = TINY_FAMILIES[family]
        tensors = random_weights(config)
        for n in (2, 4):
            model = jax_port.load_model(config, tensors, "float32", tensor_parallel=n)
            for T in (5, 1):
                with jax.enable_x64(True):  # as the port runs it (jax_impl/port.py's exact)
                    tokens = jax.device_put(np.zeros((2, T), np.int32), model.emb.embedding[...].sharding)
                    cache = init_cache(model.config, 2, 8, np.float32)
                    compiled = jax_generate._forward.lower(*split_model(model), tokens, cache, None).compile()
                text = compiled.as_text()
                for name in COLLECTIVES:  # an op, not an operand's name (%all-reduce.3): a space before it
                    counts[f"{family}/{n}/{T}/{name}"] = np.array(len(re.findall(rf"\s{name}(?:-start)?\(", text)))
    np.savez(out, **counts)


def tensor_parallel_subprocess(out: Path, runs: dict[str, tuple[str, ...]]) -> dict[str, dict[str, np.ndarray]]:
    """`tensor_parallel_runs` for each dtype -> cases of `runs`, then `tensor_parallel_collectives`,
    one after the other in one fresh Python with 4 simulated CPU devices (one start, one import of
    JAX and torch); each dtype's arrays by key, and the collectives' under "collectives"."""
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"}
    paths = {dtype: f"{out}.{dtype}.npz" for dtype in runs}
    calls = [f"tensor_parallel_runs({paths[dtype]!r}, {dtype!r}, {cases!r})" for dtype, cases in runs.items()]
    paths["collectives"] = f"{out}.collectives.npz"
    calls.append(f"tensor_parallel_collectives({paths['collectives']!r})")
    code = f"from tests.helpers.parallel import tensor_parallel_collectives, tensor_parallel_runs; {'; '.join(calls)}"
    root = Path(__file__).resolve().parents[2]  # the repository: tests/helpers/parallel.py
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=root, timeout=900)
    arrays = {}
    for name, path in paths.items():
        with np.load(path) as saved:
            arrays[name] = {key: saved[key] for key in saved.files}
    return arrays
