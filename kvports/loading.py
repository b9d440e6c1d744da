"""Loading, the first half of the run layer: weights files opened (GGUF files through the load
cache, `formats.gguf.cache`; a draft model's as the model's), their tokenizers and chat templates,
a framework's port imported (JAX's compilation cache switched on), and a model loaded onto its
device (`load_model`, the one way a port's model is loaded, its drafts kept beside it).

    with open_model(weights) as file:
        config = header(file, "float32")            # the header alone: check the run against it
        ...                                         # the command's checks (generating.check_inputs)
        tensors = read_tensors(file, "float32")     # only then is a tensor read
    loaded = load_model("numpy", config, tensors, "float32", "cpu")

The other half, `generating`, checks a run's inputs and generates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvports import registry
from kvports.devices import (
    check_device,
    check_gpu_reachable,
    check_parallel_devices,
    device_problem,
    placement,
    prepare_tensor_parallel,
)
from kvports.formats.weights import DEFAULT_WEIGHTS, open_weights
from kvports.limits import check_bytes, release_freed_memory
from kvports.shared.checks import COMMAND_LINE, Names
from kvports.shared.config import ModelConfig, host_dtype
from kvports.shared.contract import Port
from kvports.shared.errors import UserError
from kvports.shared.shapes import parameter_count
from kvports.threads import settle_threads
from kvports.validation import (
    check_q4_file,
    shown,
)

Tensors = dict[str, np.ndarray]
NOT_INSTALLED = "not installed"  # `usable_ports`' reason for a framework that is missing, by default


@dataclass
class LoadedModel:
    """One framework's model on one device, with the draft models loaded for it so far."""

    port: Port
    model: Any
    config: ModelConfig
    framework: str
    dtype: str
    device: str
    drafts: dict[str, tuple[ModelConfig, Any]] = field(default_factory=dict)  # source -> (config, model)
    quant: str = "none"  # the model's (a draft runs unquantized)
    tensor_parallel: int = 1  # the draft is split across the same devices

    @property
    def route(self) -> str:
        """The kernel its linears take (`Port.linear_route`), so a slower fallback on this CPU is visible."""
        return self.port.linear_route(self.dtype, self.quant, self.device)

    def add_draft(self, source: str, config: ModelConfig, tensors: Tensors) -> None:
        model = self.port.load_model(config, tensors, self.dtype, self.device, tensor_parallel=self.tensor_parallel)
        self.drafts[source] = (config, model)


def open_model(weights: Path | None) -> Any:
    """A model's weights file, open (None: the seed's model), a draft's as the model's: a GGUF file
    through the load cache (mapped from what its first load kept, `formats.gguf.cache`), any other
    as `open_weights` opens it. Its `config` is the header's, read before any tensor: check the
    run against `header(file, dtype)`, then `read_tensors`."""
    from kvports.formats.gguf.cache import open_gguf
    from kvports.formats.gguf.reader import is_gguf

    path = weights if weights is not None else DEFAULT_WEIGHTS
    return open_gguf(path) if is_gguf(path) else open_weights(path)


def header(file: Any, dtype: str) -> ModelConfig:
    """An open weights file's config, checked to hold at `dtype`: the header alone, no tensor read."""
    return file.config.validate_at(dtype)


def read_tensors(file: Any, dtype: str, quant: str = "none", names: Names = COMMAND_LINE) -> Tensors:
    """An open file's tensors at `dtype`, read once the run was checked against its header. quant
    "q4": the file's 4-bit blocks too, beside the dequantized weights (a file without any is refused)."""
    check_q4_file(quant, file.has_q4(), file.source, names)
    return file.read(dtype, quant)


def check_weights(config: ModelConfig, dtype: str) -> None:
    """The bytes of a model's weights (twice: read, then the framework's copy) against the limit."""
    count = parameter_count(config)
    check_bytes({"weights": 2 * count * np.dtype(host_dtype(dtype)).itemsize}, f"a model of {count:,} parameters")


def model_tokenizer(weights: Path | None, config: ModelConfig) -> Any:
    """A weights file's own tokenizer, checked against the model's vocabulary: a GGUF file's (its
    metadata), or the tokenizer.json `kvports convert` wrote beside a safetensors file; else None."""
    from kvports.formats.hf.text import check_vocabulary, load_tokenizer

    if weights is None:
        return None
    from kvports.formats.gguf.tokenizer import gguf_tokenizer, has_tokenizer

    if has_tokenizer(weights):
        return check_vocabulary(gguf_tokenizer(weights), config.vocab_size)
    beside = tokenizer_beside(weights)
    return None if beside is None else check_vocabulary(load_tokenizer(beside), config.vocab_size)


def tokenizer_beside(weights: Path) -> Path | None:
    """The tokenizer.json `kvports convert` keeps beside the weights it writes (a folder's, with --to-hf)."""
    folder = weights if weights.is_dir() else weights.parent
    found = folder / "tokenizer.json"
    return found if found.is_file() and not weights.suffix == ".gguf" else None


def chat_ids(weights: Path | None, messages: list[dict[str, str]], tokenizer: Any) -> list[int]:
    """A chat's prompt ids in the weights' own template (a GGUF file's, or the chat template
    `kvports convert` kept beside the weights)."""
    from kvports.formats import chat

    if weights is None:
        raise UserError("a chat needs a model with a chat template: give --model NAME or --weights FILE.gguf")
    return chat.chat_ids(weights, messages, tokenizer)


def load_port(framework: str) -> Port:
    """The framework's port: one that is not installed is a user error."""
    try:
        port = registry.load_port(framework)
    except registry.PortUnavailable as exc:
        raise UserError(str(exc)) from None
    settle_threads()  # torch's thread pools exist only once it is imported
    if framework == "jax":
        use_jax_cache()
    return port


JAX_CACHE_VARIABLE = "KVPORTS_JAX_CACHE"  # "0": JAX compiles every run again


def use_jax_cache() -> None:
    """JAX's persistent compilation cache under $KVPORTS_HOME/jax, on unless KVPORTS_JAX_CACHE=0 (or
    --no-jax-cache) or JAX_COMPILATION_CACHE_DIR already names one: a second run of the same shapes
    loads what the first compiled instead of compiling the layer loop again."""
    import os

    if os.environ.get(JAX_CACHE_VARIABLE, "1") in ("0", "false", "no", "off") or os.environ.get(
        "JAX_COMPILATION_CACHE_DIR"
    ):
        return
    import jax

    from kvports.hub import home

    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(home() / "jax"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # the small helpers too: they add up


def port_for(
    framework: str, device: str, tensor_parallel: int = 1, names: Names = COMMAND_LINE, port: Port | None = None
) -> Port:
    """One framework's port, imported (`port`: imported already, by `usable_ports`), that reaches
    `device` and has `tensor_parallel` devices there: what only the imported port can tell, refused
    after `check_rules` and before any model loads."""
    prepare_tensor_parallel(tensor_parallel, device, [framework])  # before the port's import starts JAX
    port = load_port(framework) if port is None else port
    check_device(port, device, shown(names, "device", device))
    check_parallel_devices(framework, device, tensor_parallel, shown(names, "tensor_parallel", tensor_parallel))
    return port


def usable_ports(
    frameworks: Sequence[str],
    device: str,
    tensor_parallel: int = 1,
    names: Names = COMMAND_LINE,
    missing: Callable[[str], str] = lambda framework: NOT_INSTALLED,
) -> tuple[dict[str, Port], dict[str, str]]:
    """`port_for` for a command that runs several frameworks (compare, the benches): each one's
    port, or the reason its rows give (`missing(framework)` for one not installed, else why it
    finds no GPU). Refused when none reaches a GPU asked for, or a split asks more devices than
    a port has."""
    prepare_tensor_parallel(tensor_parallel, device, frameworks)  # before the first import starts JAX
    ports: dict[str, Port] = {}
    reasons: dict[str, str] = {}
    problems: dict[str, str | None] = {}
    for name in frameworks:
        port = registry.available_port(name)
        problems[name] = (registry.outdated(name) or missing(name)) if port is None else device_problem(port, device)
        if port is not None and problems[name] is None:
            ports[name] = port
        else:
            reasons[name] = str(problems[name])
    settle_threads()  # torch's thread pools exist only once it is imported
    if "jax" in ports:
        use_jax_cache()
    check_gpu_reachable(device, problems, shown(names, "device", device))
    for name in ports:
        check_parallel_devices(
            name, placement(name, device), tensor_parallel, shown(names, "tensor_parallel", tensor_parallel)
        )
    return ports, reasons


def load_model(
    framework: str,
    config: ModelConfig,
    tensors: Tensors,
    dtype: str,
    device: str,
    names: Names = COMMAND_LINE,
    quant: str = "none",
    tensor_parallel: int = 1,
    port: Port | None = None,
) -> LoadedModel:
    """The one way a port's model is loaded, once its caller has held the run to `check_rules`
    (before any file was read): `port_for` (`port`: imported already), then the port's own load.
    `device`: where this framework runs (`devices.placement`: NumPy on the CPU)."""
    port = port_for(framework, device, tensor_parallel, names, port)
    model = port.load_model(config, tensors, dtype, device, quant=quant, tensor_parallel=tensor_parallel)
    release_freed_memory()
    return LoadedModel(port, model, config, framework, dtype, device, quant=quant, tensor_parallel=tensor_parallel)
