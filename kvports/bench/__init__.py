"""`kvports bench`: every port x {naive, cached} (and, with a draft, speculative) beside two
baselines, timed step by step.

Each row runs two kinds of call, both after --warmup untimed runs, --repeats times:
- `generate()`, the whole generation as a user calls it: total time and tokens/s.
  For JAX that is the compiled loop, so the first call's extra time is its compile time.
- `generate(..., on_token=...)`, the same tokens with the clock read as each token reaches
  the host: the per-step latency curve, time to first token (step 0: prefill plus the first
  token) and the decode time per token (median and p90 over steps 1..N-1).
Every figure is the median over repeats; the JSON keeps every repeat. Nothing here
asserts a timing: the development targets are measured, kept in the JSON and printed
only with --targets. A row that cannot run keeps its number columns empty and gives its
reason in a column of its own.

For the gpt2-small preset each row also gets a roofline: the bytes a decoded token
must read (weights plus the KV cache so far) over this machine's streaming bandwidth,
measured in the same run by a large float32 matrix-vector product.

One module per job:
- `options`: the command's flags and their checks
- `presets`: the model and prompts timed (the seed's, or GPT-2 small as published with random weights)
- `formats`: the weight formats (--dtype and --quant lists) each port runs
- `runners`: what is timed (the ports, the baselines, the torch.compile row) and the notes on each
- `measure`: the clocks: one row's timings, bandwidth, the bytes a decode step reads
- `rows`: every runner x mode, run and compared (speed-ups, tokens agreeing, rooflines)
- `targets`: the development speed targets, and each row's peer (the engine its weight format is held to)
- `table`: the table printed on the terminal
- `output`: JSON, CSV (to a file or stdout) or the table
- `plots`: the PNGs, rewritten as each framework's rows finish
- `rounds`: `--threads N1,N2` and `--rounds R`: a process per round and thread count, interleaved, merged
- `command`: the subcommand, tying these together
- `serve_command`, `requests_command`: `bench --serve` and `bench --requests`, the commands behind them
- `serving`: `bench --serve`, kvports serve (and llama.cpp's server) under concurrent clients
- `throughput`: `--requests N` (and `kvports batch --bench`): continuous batching against one request at a time
"""

from kvports.bench.command import run
from kvports.bench.options import add_arguments

HELP = "time every framework x mode against the seed's cache and transformers: table, JSON, CSV, plots"

__all__ = ["HELP", "add_arguments", "run"]
