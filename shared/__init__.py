"""Framework-neutral parts of kvports. Imports NumPy (and safetensors, rich) and nothing
heavier: matplotlib, tokenizers and transformers only inside the functions that need them.

The core, which the ports import:
- `config`: ModelConfig, the hyperparameters every port reads; KV-cache sizes
- `weights`: the safetensors weights file every port loads
- `checks`: every input check, with its message, before any framework code runs
- `compare`: token comparison with float32's near-ties explained; logit differences
- `generation`: how to generate (sampling settings, stop ids, seed), the shared random draws, ragged prompts
- `contract`: what a port must provide (`Port`), and a bench baseline (`Baseline`)
- `ports`: ports imported by name, lazily; one whose framework is not installed is reported as unavailable
- `limits`: the bytes a run may allocate
- `errors`, `files`, `families`, `progress`: small pieces the above and the tools share

The tools, which no port imports:
- `run`: the run layer under the command line and the Python API: typed inputs, checked once,
  one `generate` for every mode, a typed result
- `cli`: the `kvports` command line (parses and dispatches); `arguments`: the argparse types
- `commands/`: generate, compare, batch, init-weights, convert
- `bench/`: `kvports bench`, one module per job (measuring, rows, targets, table, plots, batching)
- `batching/`: the continuous-batching engine (requests, blocks, scheduler, engine)
- `hf/`: Hugging Face directories in and out (config and tensor mapping, import, export, text)
- `devices`: `--device` (where each framework runs, and why one cannot); `terminal`: tables printed whole
"""
