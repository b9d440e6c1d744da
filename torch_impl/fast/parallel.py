"""Tensor parallelism in PyTorch: N processes on torch.distributed, each holding a share of every
attention's heads and of every FFN's inner width (Megatron's split), the products sharded by
torch.distributed.tensor.parallel over a one-dimensional DeviceMesh.

q, k, v and the FFN's first product are ColwiseParallel: each rank computes its own output
columns (its heads; its slice of the inner width) from the whole input. The attention's output
product and the FFN's second are RowwiseParallel: each rank multiplies its slice of the input by
its columns of the weight, and DTensor all-reduces the partial sums. Between the two a rank
attends over its own heads with its own KV cache, which holds only its key/value heads. The
embedding, the norms and the head stay whole on every rank: the [B, T, D] activations between
the blocks are replicated, so every rank samples the same tokens.

The port's contract is NumPy in, NumPy out, in one process. A ParallelModel keeps it: it spawns
the ranks (gloo on the CPU, NCCL on GPUs), sends each call to all of them, every rank runs the
port's own generate on its shard (the same loops as one process), and rank 0's answer comes
back, each token as it is made when the caller streams. A rank that fails ends every rank, and
the call raises with its message; the ranks also end when the ParallelModel is closed, collected
or the interpreter exits, and each rank ends itself when its parent is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError

TIMEOUT = timedelta(minutes=30)  # gloo's and NCCL's wait for a peer; a dead peer is the parent's to notice first
FAILURE_GRACE = 1.0  # seconds to collect every rank's report once one fails: the first may be only an echo


def rank_heads(config: ModelConfig, n: int, rank: int) -> tuple[range, range]:
    """The query heads and the key/value heads rank `rank` of n computes. Key/value heads are split
    when n divides them; when n exceeds them, each rank holds a copy of the one its query heads
    share (vLLM's rule): n / Hkv ranks hold each."""
    H, Hkv = config.n_heads, config.kv_heads
    local = H // n
    first = rank * local
    kv_first = first // (H // Hkv)  # a query head h uses key/value head h // G
    return range(first, first + local), range(kv_first, kv_first + max(Hkv // n, 1))


def describe(config: ModelConfig, n: int, backend: str) -> str:
    """One line on how the heads are laid out over the ranks (what `kvports generate` shows)."""
    H, Hkv = config.n_heads, config.kv_heads
    queries, kv = rank_heads(config, n, 0)
    line = f"tensor parallel over {n} ranks ({backend}): {len(queries)} of {H} query heads per rank, "
    if n > Hkv:
        return line + f"key/value heads replicated: {Hkv} of them, each copied on {n // Hkv} ranks"
    return line + f"{len(kv)} of {Hkv} key/value heads"


def block_rows(blocks: Sequence[int], width: int) -> torch.Tensor:
    """The rows of blocks `width` rows tall, in the order given: [len(blocks) * width]."""
    return torch.cat([torch.arange(block * width, (block + 1) * width) for block in blocks])


def reorder_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    # A fused product ([q | k | v], SwiGLU's [gate | up]) laid out rank after rank, so that
    # ColwiseParallel's even split along the output dim hands each rank its own parts of every piece.
    linear.weight = nn.Parameter(linear.weight[rows], requires_grad=False)  # [rows, in]
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias[rows], requires_grad=False)  # [rows]


def shard(model: Any, mesh: Any, n: int, rank: int) -> Any:
    """The whole TinyModel, made this rank's shard in place: its heads and FFN slice, its cache's config."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    config = model.config
    H, Hkv, Dh, F = config.n_heads, config.kv_heads, config.head_dim, config.ffn_dim
    gated = config.gated  # SwiGLU, GELU-gated: gate and up fused in ffn.0
    qkv_blocks: list[int] = []  # heads of the fused [H + 2 Hkv] head axis, rank after rank
    ffn_blocks: list[int] = []  # slices F / n wide of the first product's output, rank after rank
    for r in range(n):
        queries, kv = rank_heads(config, n, r)
        qkv_blocks += [*queries, *(H + j for j in kv), *(H + Hkv + j for j in kv)]
        ffn_blocks += [r, n + r] if gated else [r]  # gated: the rank's gate slice, then its up slice
    qkv_rows, ffn_rows = block_rows(qkv_blocks, Dh), block_rows(ffn_blocks, F // n)
    model.requires_grad_(False)
    for block in model.blocks:
        reorder_rows(block.qkv, qkv_rows)
        reorder_rows(getattr(block.ffn, "0"), ffn_rows)
        for product in (block.qkv, block.proj, *block.ffn.children()):
            # Plain F.linear: oneDNN's op (fast/onednn.py) has no DTensor sharding rule.
            product.__class__ = nn.Linear
    plan = {
        "blocks.*.qkv": ColwiseParallel(),  # [B, T, D] replicated -> this rank's q, k and v heads
        "blocks.*.proj": RowwiseParallel(),  # this rank's heads' outputs -> all-reduced [B, T, D]
        "blocks.*.ffn.0": ColwiseParallel(),  # -> this rank's slice of the inner width
        "blocks.*.ffn.2": RowwiseParallel(),  # -> all-reduced [B, T, D]
    }
    parallelize_module(model, mesh, plan, src_data_rank=None)  # every rank has the whole weights: no scatter
    # What the rank's attention and cache read: its own heads, and their width as d_model, so that
    # head_dim stays the model's. The residual stream stays D wide: the norms and the embedding
    # read their width from their weights, never from the config.
    queries, kv = rank_heads(config, n, rank)
    local = dataclasses.replace(config, d_model=len(queries) * Dh, n_heads=len(queries), n_kv_heads=len(kv))
    model.config = local
    for block in model.blocks:
        block.config = local
    return model


@dataclasses.dataclass(frozen=True)
class PortCalls:
    """The port's own functions a rank runs, handed over by the port: this module imports no port (the
    port imports it), and spawn pickles module-level functions by name, so a rank imports the port itself."""

    load_model: Callable[..., Any]
    generate: Callable[..., Any]
    generate_speculative: Callable[..., Any]
    forward_chunks: Callable[..., Any]


def load_shard(
    config: ModelConfig,
    tensors: dict[str, np.ndarray],
    dtype: str,
    device: str,
    n: int,
    rank: int,
    store: Any,
    port: PortCalls,
) -> Any:
    """This process's shard, once it has joined the group of n (store None: torchrun's environment)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if device == "gpu":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        torch.set_num_threads(max(1, torch.get_num_threads() // n))  # the ranks share the cores
    backend = "nccl" if device == "gpu" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=n, timeout=TIMEOUT)
    mesh = init_device_mesh("cuda" if device == "gpu" else "cpu", (n,))
    return shard(port.load_model(config, tensors, dtype, device), mesh, n, rank)


# ---------------------------------------------------------------- a rank


def watch_parent(parent: int) -> None:
    # A rank whose parent died (killed, never closing it) ends itself, even inside a collective.
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def serve(
    rank: int,
    n: int,
    store_port: int,
    device: str,
    dtype: str,
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    conn: Connection,
    parent: int,
    port: PortCalls,
) -> None:
    """A rank's life: join the group, build its shard, then run each call the parent sends until None."""
    threading.Thread(target=watch_parent, args=(parent,), daemon=True).start()
    # Ctrl-C reaches the terminal's whole process group: the parent owns it (it ends every rank and says
    # "interrupted"); a rank that took it too would race the parent with a failure of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", store_port, None, False, timeout=TIMEOUT)
        tensors = {name: tensor.numpy() for name, tensor in weights.items()}
        model = load_shard(config, tensors, dtype, device, n, rank, store, port)
        del tensors, weights
        drafts: dict[int, Any] = {}  # replicated, whole on every rank: a draft is small
        conn.send(("done", None))
        while (request := conn.recv()) is not None:
            result: Any = None
            if request[0] == "call":
                _, function, args, stream = request
                if function == "generate_speculative" and args[0] is not None:
                    args = (drafts[args[0]], *args[1:])
                # Rank 0 streams each token to the parent as it is made; the others make them in step.
                streaming = {"on_token": (lambda token: conn.send(("token", token))) if rank == 0 else None}
                result = getattr(port, function)(model, *args, **(streaming if stream else {}))
            else:
                _, key, draft_config, draft_dtype, draft_weights = request
                draft_tensors = {name: tensor.numpy() for name, tensor in draft_weights.items()}
                drafts[key] = port.load_model(draft_config, draft_tensors, draft_dtype, device)
            conn.send(("done", result if rank == 0 else None))
        dist.destroy_process_group()
    except EOFError:
        pass  # the parent is gone
    except BaseException as error:  # whatever it is, the parent reports it and ends every rank
        message = str(error).strip().splitlines()
        with contextlib.suppress(OSError):  # a parent already gone cannot be told
            conn.send(("error", f"{type(error).__name__}: {message[0] if message else ''}"))


# ---------------------------------------------------------------- the parent's handle


def stop(processes: list[Any], conns: list[Connection]) -> None:
    """End every rank: ask, then terminate, then kill; each one joined."""
    for conn in conns:
        with contextlib.suppress(OSError):  # a rank already gone needs no asking
            conn.send(None)
    deadline = time.monotonic() + 2.0
    started = [process for process in processes if process.pid is not None]
    for process in started:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in started:
        if process.is_alive():
            process.terminate()
            process.join(2.0)
        if process.is_alive():
            process.kill()
            process.join()
    for conn in conns:
        conn.close()


class ParallelModel:
    """A model sharded over N spawned ranks; the port's functions take it where they take a TinyModel."""

    def __init__(
        self, config: ModelConfig, dtype: str, device: str, n: int, weights: dict[str, torch.Tensor], port: PortCalls
    ):
        import torch.distributed as dist
        import torch.multiprocessing as mp

        self.config, self.dtype, self.device, self.tensor_parallel = config, dtype, device, n
        self.layout = describe(config, n, "nccl" if device == "gpu" else "gloo")
        # The rendezvous the ranks meet at, on a port the system picks: no race for a free one.
        self._store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=TIMEOUT, wait_for_workers=False)
        context = mp.get_context("spawn")  # a fresh interpreter per rank: no forked torch threads
        pipes = [context.Pipe() for _ in range(n)]
        self.processes = [
            context.Process(
                target=serve,
                args=(rank, n, self._store.port, device, dtype, config, weights, child, os.getpid(), port),
                daemon=True,
                name=f"kvports-tp-rank{rank}",
            )
            for rank, (_, child) in enumerate(pipes)
        ]
        self._conns = [parent for parent, _ in pipes]
        self._drafts: dict[int, Any] = {}  # id -> the draft itself, so that its id stays its own
        self._stop = weakref.finalize(self, stop, self.processes, self._conns)  # at close, collection or exit
        for process in self.processes:
            process.start()
        for _, child in pipes:
            child.close()  # the parent keeps only its ends: a rank's death is an EOF here
        self._collect(None)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def close(self) -> None:
        self._stop()

    def call(self, function: str, *args: Any, on_token: Callable[[np.ndarray], None] | None = None) -> Any:
        """port.<function>(the rank's shard, *args, on_token=...) on every rank: rank 0's result.
        generate_speculative's draft (its first argument) is loaded whole on every rank first."""
        if not self._stop.alive:
            raise RuntimeError("this tensor-parallel model's ranks have ended; load it again")
        if function == "generate_speculative" and args[0] is not None:
            args = (self._load_draft(args[0]), *args[1:])
        return self._send(("call", function, args, on_token is not None), on_token)

    def _send(self, request: tuple[Any, ...], on_token: Callable[[np.ndarray], None] | None = None) -> Any:
        try:
            for rank, conn in enumerate(self._conns):
                try:
                    conn.send(request)
                except OSError:  # a rank already gone: its pipe is closed (not the caller's stdout)
                    self.processes[rank].join(1.0)
                    raise RankFailed(rank, len(self._conns), exit_description(self.processes[rank].exitcode)) from None
            return self._collect(on_token)
        except BaseException:
            # Interrupted, or on_token raised: the ranks are mid-call, out of step with this handle.
            self.close()
            raise

    def _collect(self, on_token: Callable[[np.ndarray], None] | None) -> Any:
        """Every rank's answer, rank 0's returned; any failure ends every rank and raises its message."""
        answered: dict[int, Any] = {}
        failures: list[tuple[int, int, str]] = []  # (priority, rank, message): a death first, then an error
        deadline = None
        while len(answered) < len(self._conns) and (deadline is None or time.monotonic() < deadline):
            pending = [rank for rank in range(len(self._conns)) if rank not in answered]
            objects = [self._conns[rank] for rank in pending] + [self.processes[rank].sentinel for rank in pending]
            ready = wait(objects, None if deadline is None else max(0.0, deadline - time.monotonic()))
            for rank in pending:
                if self._conns[rank] in ready:
                    try:
                        kind, value = self._conns[rank].recv()
                    except EOFError:
                        kind, value = "died", None
                    if kind == "token" and on_token is not None:
                        on_token(value)
                    elif kind == "done":
                        answered[rank] = value
                    elif kind == "error":
                        failures.append((1, rank, value))
                        answered[rank] = None
                if rank not in answered and self.processes[rank].sentinel in ready:
                    self.processes[rank].join(1.0)
                    failures.append((0, rank, exit_description(self.processes[rank].exitcode)))
                    answered[rank] = None
            if failures and deadline is None:
                deadline = time.monotonic() + FAILURE_GRACE
        if failures:
            self.close()
            _, rank, message = min(failures)
            raise RankFailed(rank, len(self._conns), message)
        return answered[0]

    def _load_draft(self, draft: Any) -> int:
        """The draft, a TinyModel, whole on every rank (its weights sent once)."""
        key = id(draft)
        if key not in self._drafts:
            dtype = str(draft.emb.weight.dtype).removeprefix("torch.")
            weights = {name: tensor.detach().cpu().clone() for name, tensor in draft.state_dict().items()}
            self._send(("draft", key, draft.config, dtype, weights))
            self._drafts[key] = draft
        return key


class RankFailed(UserError, RuntimeError):
    """A rank that died or raised, every rank ended: one `error:` line, as the command line prints a
    UserError (a RuntimeError too: the run failed, and not for a bad argument)."""

    def __init__(self, rank: int, n: int, message: str):
        super().__init__(f"tensor-parallel rank {rank} of {n} failed: {message}")


def exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        return f"died (signal {-code})"
    return f"exited with status {code}"


def load_parallel(
    config: ModelConfig, tensors: dict[str, np.ndarray], dtype: str, device: str, n: int, port: PortCalls
) -> Any:
    """The model sharded over n ranks; `Any`: the port's functions take it where they take a TinyModel.
    The caller has checked n against the model (shared/checks.py): it divides the query heads and the
    FFN width, and divides the key/value heads or is a multiple of them."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return load_under_torchrun(config, tensors, dtype, device, n, port)
    # Into shared memory once: each rank maps the same pages instead of receiving a copy.
    weights = {name: torch.from_numpy(np.array(array)).share_memory_() for name, array in tensors.items()}
    return ParallelModel(config, dtype, device, n, weights, port)


def load_under_torchrun(
    config: ModelConfig, tensors: dict[str, np.ndarray], dtype: str, device: str, n: int, port: PortCalls
) -> Any:
    """Under torchrun every rank runs the whole command, this process being one of them: its shard,
    a TinyModel the port's functions run as they run any (every rank computes the same tokens).
    Only rank 0's output shows; torchrun ends every rank when one fails."""
    import atexit
    import sys

    import torch.distributed as dist

    from kvports.shared.errors import UserError

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world != n:
        raise UserError(f"tensor_parallel={n} must equal torchrun's number of processes ({world})")
    model = load_shard(config, tensors, dtype, device, n, rank, None, port)
    atexit.register(dist.destroy_process_group)
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # for the rest of the process
    return model
