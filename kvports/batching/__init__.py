"""Continuous batching over a paged KV cache, framework-free (docs/BATCHING.md).

One module per job:
- `request`: the one request type every front door makes, and `check_request`, its one check
- `request_file`: a batch file's JSON lines, each parsed into a request and checked
- `blocks`: the block manager: allocation, reference counts, prefix hashing
- `scheduler`: waiting queue, running batch, prefill and decode steps, preemption
- `engine`: the scheduler's steps run by one port (its `init_block_pool` and `paged_step`)

The `kvports batch` command is `kvports/commands/batch.py`; the batching benchmark (continuous
batching against the same requests one after another) is `kvports/bench/throughput.py`.
"""
