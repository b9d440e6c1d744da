"""What the three ports share, framework-neutral: NumPy and nothing of the application.

- `config`: ModelConfig, the hyperparameters every port reads; KV-cache sizes
- `rope`: RoPE's frequencies for a layer (plain, Llama 3's scaling, Gemma 3's local base)
- `shapes`: the model's tensors by name and shape (the state_dict every port's TinyModel holds)
- `generation`: how to generate (sampling settings, stop ids, seeds), the shared random draws, padding
- `quantization`: int8 and 4-bit codes, made once for every port that quantizes
- `checks`: the checks the ports' own calls make (generation settings, chunk sizes, key/value layout)
- `capabilities`: what each port can run (modes, precisions, devices), one record each
- `cpu`: the CPU's instruction sets, asked once, for the routes that need them
- `contract`: what a port must provide (`Port`), and a bench baseline (`Baseline`)
- `errors`, `files`: the one-line user error, and files written atomically

The application (the command line, the run layer, the bench, batching, the checker, file
formats) is the `kvports` package beside this folder, built on top of it.
"""
