"""Framework-neutral parts of kvports. Imports NumPy (and safetensors, rich) and nothing
heavier: matplotlib, tokenizers and transformers only inside the functions that need them.

The core, which the ports import:
- `config`: ModelConfig, the hyperparameters every port reads; KV-cache sizes
- `weights`: the safetensors weights file every port loads
- `checks`: input checks that run before any framework code
- `compare`: token comparison with float32's near-ties explained; logit differences
- `generation`: how to generate (sampling settings, stop ids, seed), the shared random draws, ragged prompts
- `contract`: what a port must provide (`Port`), and a bench baseline (`Baseline`)
- `ports`: ports imported by name, lazily; a missing one is reported as unavailable
- `errors`, `files`, `families`, `progress`: small pieces the above and the tools share

The tools, which no port imports:
- `cli`: the `kvports` command line (parses and dispatches)
- `commands/`: generate, compare, init-weights, convert
- `bench/`: `kvports bench`, one module per job (measuring, rows, targets, table, plots)
- `hf/`: Hugging Face directories in and out (config and tensor mapping, import, export, text)
- `devices`: `--device` (where each framework runs, and why one cannot); `terminal`: tables printed whole
"""
