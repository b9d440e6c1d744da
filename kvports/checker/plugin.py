"""Loading an implementation to check, in either of its two interfaces, behind one driver.

- The post's interface: a Python file defining a PyTorch `TinyModel` (the seed's parameter
  names), `generate_naive(model, prompt, n)` and `generate_cached(model, prompt, n)`; its
  `forward(idx)` or `forward(idx, caches)`, caches a list of one dict per block that the model
  fills, returning logits [B, T, V] (or a tuple whose first item they are).
- The adapter: a module or file with `load(config: dict, weights: dict[str, ndarray])`,
  `full(model, tokens [B, T]) -> logits [B, T, V]` and
  `step(model, tokens [B, T], state) -> (logits [B, T, V], state)` (state None: a new cache).

A file is imported under a private module name, so its `if __name__ == "__main__":` block
does not run. Everything that makes a plug-in unusable (no such file, a syntax error, a
missing function, wrong parameter names, a first call that fails or returns the wrong
shape or NaN) is a UserError, found before any check runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError, echo, echo_path

POST = ("TinyModel", "generate_naive", "generate_cached")
ADAPTER = ("load", "full", "step")
LOW_PRECISION = ("bfloat16", "float16")  # logits an implementation may compute in, held at their own precision
_imported = 0  # a private module name per file imported
_listeners: list[Callable[[dict[str, Any]], None]] = []  # who hears each call start and end (the child process)


def notify(event: dict[str, Any]) -> None:
    """Tell whoever listens (isolate.py's child: its parent, which times each call) what runs now."""
    for listener in _listeners:
        listener(event)


@contextlib.contextmanager
def listening(listener: Callable[[dict[str, Any]], None]) -> Iterator[None]:
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)


class ImplementationError(Exception):
    """The implementation raised while a check ran it: which function, what it said, a hint."""

    def __init__(self, function: str, error: BaseException):
        self.function, self.error = function, error
        self.after_first_chunk = False
        super().__init__(f"{function} raised {type(error).__name__}: {one_line(error)}")

    @property
    def line(self) -> str:
        """The implementation's own line where it raised (file:line), if the traceback has one."""
        frames = [frame for frame in traceback.extract_tb(self.error.__traceback__) if "kvports" not in frame.filename]
        return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""

    def hint(self) -> str:
        message = str(self.error)
        if "Sizes of tensors must match except in dimension 0" in message or "must have same number of dim" in message:
            return "torch.cat joins along dim 0 unless told; a new token [B, 1] joins the history [B, T] with dim=1"
        if "'NoneType' object has no attribute" in message:
            return "the naive path passes no cache: check for None before using one"
        if isinstance(self.error, (RuntimeError, ValueError)) and ("size" in message or "shape" in message):
            return "a shape that fits the first call but not the next: check how the cache grows"
        if isinstance(self.error, SystemExit):
            return "a function under check must return its result, not end the process (sys.exit, exit(), quit())"
        if isinstance(self.error, KeyboardInterrupt):
            return "the implementation raised KeyboardInterrupt itself; a checked function must return"
        if isinstance(self.error, MemoryError):
            return "an allocation far larger than the model needs: check the shapes of the buffers it makes"
        return "run the function by hand on this input to see the traceback"


@contextlib.contextmanager
def marked(start: int) -> Iterator[None]:
    """An error raised by a cached call after the first (the prefill) says so: the cache broke it."""
    try:
        yield
    except ImplementationError as error:
        error.after_first_chunk = start > 0
        raise


def one_line(error: BaseException) -> str:
    if isinstance(error, SystemExit):
        return f"exit status {error.code!r}" if not isinstance(error.code, str) else error.code[:300]
    return " ".join(str(error).split())[:300] or type(error).__name__


def dtype_name(array: Any) -> str:
    """An array-like's element type as a short name (torch.bfloat16 -> bfloat16), '' for a list."""
    return str(getattr(array, "dtype", "")).rsplit(".", 1)[-1]


def to_numpy(array: Any) -> np.ndarray:
    """Any array-like as its values: NumPy, torch (any device, bfloat16 too), JAX, nested lists."""
    if hasattr(array, "detach"):  # a torch tensor
        array = array.detach().cpu()
        if dtype_name(array) in LOW_PRECISION:
            array = array.float()
        return array.numpy()
    if isinstance(array, (list, tuple)):  # a nested list of numbers, or a list of tensors: each item as its values
        with contextlib.suppress(ValueError, TypeError):
            numbers = np.asarray(array)
            if numbers.dtype != object:
                return numbers
        return np.asarray([to_numpy(item) for item in array])
    if not hasattr(array, "__array__") and callable(getattr(array, "numpy", None)):  # TensorFlow's eager tensors
        array = array.numpy()
    array = np.asarray(array)
    return array.astype(np.float32) if dtype_name(array) == "bfloat16" else array  # ml_dtypes' bfloat16 (JAX)


def first_output(out: Any) -> Any:
    """The logits in what a forward returned: the array itself, a tuple (logits, ...), an object with .logits
    (transformers' outputs); a nested list of numbers is an array, not a tuple."""
    logits = getattr(out, "logits", None)
    if logits is not None:
        return logits
    if isinstance(out, tuple) or (isinstance(out, list) and out and not np.isscalar(out[0]) and np.ndim(out[0]) != 2):
        return out[0]
    return out


def tokens_of(args: tuple, kwargs: dict[str, Any]) -> Any:
    """Which argument of a forward call is the tokens: the first integer array among its positional and
    keyword arguments (input_ids=...), else its first argument of any kind."""
    values = [*args, *kwargs.values()]
    for value in values:
        if hasattr(value, "shape") and ("int" in dtype_name(value)):
            return value
    return values[0] if values else None


def shape_of(value: Any) -> tuple[int, ...]:
    try:
        return tuple(int(n) for n in np.shape(value))
    except (TypeError, ValueError):
        return ()


@contextlib.contextmanager
def on_path(folder: str) -> Iterator[None]:
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        yield
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)


def import_target(target: str | ModuleType) -> ModuleType:
    """A module object, a file path (imported under a private name: its __main__ block does not
    run) or an importable module name."""
    global _imported
    if isinstance(target, ModuleType):
        return target
    path = Path(target)
    if target.endswith(".py") or path.exists() or "/" in target:
        if not path.is_file():
            raise UserError(f"implementation {echo_path(target)} does not exist (or is not a file)")
        _imported += 1
        name = f"_kvports_check_{_imported}_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise UserError(f"cannot import implementation {echo_path(target)} (not a Python file)")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look their module up by name
        notify({"event": "call", "function": f"import {path.name}"})
        try:
            with on_path(str(path.resolve().parent)):  # its own folder, as `python FILE` has: siblings import
                spec.loader.exec_module(module)
        except SyntaxError as exc:
            del sys.modules[name]
            raise UserError(f"cannot import {echo_path(target)}: line {exc.lineno}: {exc.msg}") from None
        except BaseException as exc:
            del sys.modules[name]
            raise UserError(f"cannot import {echo_path(target)}: {type(exc).__name__}: {one_line(exc)}") from None
        finally:
            notify({"event": "return"})
        return module
    notify({"event": "call", "function": f"import {target}"})
    try:
        with on_path(os.getcwd()):  # a console script's path lacks the folder it runs in
            return importlib.import_module(target)
    except SyntaxError as exc:
        raise UserError(f"cannot import {echo(target)}: line {exc.lineno}: {exc.msg}") from None
    except BaseException as exc:
        raise UserError(f"cannot import {echo(target)}: {type(exc).__name__}: {one_line(exc)}") from None
    finally:
        notify({"event": "return"})


def check_names(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], who: str) -> None:
    """The seed's names and shapes, or an error naming the missing and unexpected ones
    (as nanoGPT's from_pretrained asserts on them)."""
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        raise UserError(
            f"{who}'s parameter names are not the seed's: missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    for name, shape in expected.items():
        if tuple(found[name]) != tuple(shape):
            raise UserError(f"{who}'s parameter {name!r} has shape {list(found[name])}, the seed's is {list(shape)}")


class Implementation:
    """What the checks call, the same for both interfaces. NumPy in, NumPy out."""

    kind = ""
    framework = ""  # "torch" where the implementation is a torch module (the reference is then torch's)
    logits_dtype = ""  # bfloat16 or float16 where the implementation's logits come back in one
    last_only = False  # step gave a prompt's last position only: the others are not compared
    label = ""

    def build(self, config: ModelConfig, weights: dict[str, np.ndarray], dtype: str) -> Any:
        raise NotImplementedError

    def full(self, model: Any, tokens: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def can_step(self, model: Any) -> bool:
        return True

    def cached(self, model: Any, tokens: np.ndarray, chunks: list[int]) -> np.ndarray:
        """tokens [B, T] fed in chunks into one cache (the first chunk the prefill); logits [B, T, V]."""
        raise NotImplementedError

    def generators(self) -> tuple[str, ...]:
        return ("naive", "cached")

    def generate(self, model: Any, prompt: np.ndarray, n: int, mode: str) -> np.ndarray:
        """Greedy tokens [B, P + n]."""
        raise NotImplementedError

    @contextlib.contextmanager
    def counting_forwards(self, model: Any) -> Iterator[list[tuple[tuple[int, ...], float]] | None]:
        """The shapes of the model's forward calls (and when each ended) while inside; None when
        the calls cannot be seen from outside."""
        yield None

    def prefill_call(self, model: Any, prompt: np.ndarray) -> str:
        """Run the cached path's prefill on prompt [B, P] (and its first token); which function ran."""
        raise NotImplementedError

    def training(self, model: Any) -> bool:
        return bool(getattr(model, "training", False)) and has_dropout(model)

    def to_eval(self, model: Any) -> None:
        pass

    def checked_logits(self, function: str, out: Any, B: int, T: int, V: int) -> np.ndarray:
        """The logits a call returned as NumPy [B, T, V], or a UserError: the wrong shape, not floats, not finite."""
        raw = first_output(out)
        logits = to_numpy(raw)
        if dtype_name(raw) in LOW_PRECISION:  # held at its own precision, and told so
            self.logits_dtype = dtype_name(raw)
        if logits.shape != (B, T, V):
            raise UserError(
                f"{function} returned logits of shape {list(logits.shape)}, expected [B, T, V] = {[B, T, V]}"
            )
        if not np.issubdtype(logits.dtype, np.floating):
            raise UserError(f"{function} returned logits of dtype {logits.dtype}, expected floats")
        if not np.isfinite(logits).all():
            b, t, v = np.argwhere(~np.isfinite(logits))[0]
            raise UserError(
                f"{function} returned non-finite logits ({logits[b, t, v]} at row {b}, position {t}, id {v})"
            )
        return logits


def has_dropout(model: Any) -> bool:
    modules = getattr(model, "modules", None)
    if modules is None:
        return True
    return any(type(m).__name__.startswith("Dropout") and getattr(m, "p", 0) > 0 for m in modules())


def call(function: str, fn: Callable[..., Any], *args: Any) -> Any:
    """The implementation's own code runs only through here: whatever it raises (SystemExit and
    KeyboardInterrupt included) is its verdict, and a listener times each call."""
    notify({"event": "call", "function": function})
    try:
        return fn(*args)
    except UserError:
        raise
    except BaseException as exc:
        raise ImplementationError(function, exc) from exc
    finally:
        notify({"event": "return"})


def loaded_torch(label: str) -> ModuleType:
    """The torch the post's file imported. shared imports no framework of its own: it drives
    the one the implementation brought, so it never loads torch where nothing else did."""
    torch = sys.modules.get("torch")
    if torch is None:
        raise UserError(f"{echo_path(label)} defines TinyModel without importing torch (the post's interface is torch)")
    return torch


class Post(Implementation):
    """The post's file: a torch TinyModel and its two generators."""

    kind = "post"
    framework = "torch"

    def __init__(self, module: ModuleType, label: str):
        self.module, self.label = module, label

    def build(self, config: ModelConfig, weights: dict[str, np.ndarray], dtype: str) -> Any:
        torch = loaded_torch(self.label)
        model = call("TinyModel()", self.module.TinyModel)
        if not isinstance(model, torch.nn.Module):
            raise UserError(f"TinyModel() in {self.label} is a {type(model).__name__}, not a torch.nn.Module")
        found = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
        check_names({name: array.shape for name, array in weights.items()}, found, "TinyModel")
        model = model.to(getattr(torch, dtype))
        call(
            "TinyModel.load_state_dict",
            model.load_state_dict,
            {k: torch.from_numpy(np.array(v)) for k, v in weights.items()},
        )
        self.V = config.vocab_size
        self.blocks = len(getattr(model, "blocks", [])) or config.n_layers
        return model

    def run_forward(self, model: Any, tokens: np.ndarray, caches: list | None) -> np.ndarray:
        """forward(idx, caches) as the post calls it: caches a list of one dict per block for the
        cached path; for the full forward a list of None per block (the post's generate_naive), or
        nothing where forward's second parameter has a default."""
        torch = loaded_torch(self.label)
        if caches is None and self.caches_required(model):
            caches = [None] * self.blocks
        with torch.no_grad():
            idx = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
            args = (idx,) if caches is None else (idx, caches)
            logits = call(f"{type(model).__name__}.forward", model, *args)
        return self.checked_logits("TinyModel.forward", logits, tokens.shape[0], tokens.shape[1], self.V)

    def full(self, model: Any, tokens: np.ndarray) -> np.ndarray:
        return self.run_forward(model, tokens, None)

    @staticmethod
    def parameters(model: Any) -> list[inspect.Parameter]:
        try:
            return list(inspect.signature(model.forward).parameters.values())
        except (TypeError, ValueError):  # a forward with no signature to read (a C extension's)
            return []

    def can_step(self, model: Any) -> bool:
        return len(self.parameters(model)) >= 2

    def caches_required(self, model: Any) -> bool:
        parameters = self.parameters(model)
        return len(parameters) >= 2 and parameters[1].default is inspect.Parameter.empty

    def cached(self, model: Any, tokens: np.ndarray, chunks: list[int]) -> np.ndarray:
        caches: list[dict] = [{} for _ in range(self.blocks)]
        pieces, start = [], 0
        for size in chunks:
            with marked(start):
                pieces.append(self.run_forward(model, tokens[:, start : start + size], caches))
            start += size
        return np.concatenate(pieces, axis=1)

    def generate(self, model: Any, prompt: np.ndarray, n: int, mode: str) -> np.ndarray:
        torch = loaded_torch(self.label)
        name = f"generate_{mode}"
        with torch.no_grad():
            out = call(name, getattr(self.module, name), model, torch.from_numpy(np.asarray(prompt, np.int64)), n)
        tokens = to_numpy(out[0] if isinstance(out, (tuple, list)) else out)
        B, P = prompt.shape
        if tokens.shape == (B, n):
            tokens = np.concatenate([prompt, tokens], axis=1)
        if tokens.shape != (B, P + n):
            raise ImplementationError(
                name, ValueError(f"returned tokens of shape {list(tokens.shape)}, not {[B, P + n]}")
            )
        return tokens

    @contextlib.contextmanager
    def counting_forwards(self, model: Any) -> Iterator[list[tuple[tuple[int, ...], float]] | None]:
        with hooked(model) as calls:
            yield calls

    def prefill_call(self, model: Any, prompt: np.ndarray) -> str:
        self.generate(model, prompt, 1, "cached")
        return "generate_cached"

    def to_eval(self, model: Any) -> None:
        model.eval()


class Adapter(Implementation):
    """load / full / step, any framework."""

    kind = "adapter"

    def __init__(self, module: ModuleType, label: str):
        self.module, self.label = module, label
        self.framework = "torch" if "torch" in sys.modules and self._uses_torch(module) else "other"

    @staticmethod
    def _uses_torch(module: ModuleType) -> bool:
        return any(getattr(value, "__name__", "") == "torch" for value in vars(module).values())

    def build(self, config: ModelConfig, weights: dict[str, np.ndarray], dtype: str) -> Any:
        self.V = config.vocab_size
        given = dataclasses.asdict(config)
        given["ffn_hidden"], given["n_kv_heads"] = config.ffn_dim, config.kv_heads  # filled in: no guessing
        return call("load", self.module.load, given, {k: v.copy() for k, v in weights.items()})

    def full(self, model: Any, tokens: np.ndarray) -> np.ndarray:
        logits = call("full", self.module.full, model, np.array(tokens, dtype=np.int64))
        return self.checked_logits("full", logits, tokens.shape[0], tokens.shape[1], self.V)

    def one_step(self, model: Any, tokens: np.ndarray, state: Any) -> tuple[np.ndarray, Any]:
        out = call("step", self.module.step, model, np.array(tokens, dtype=np.int64), state)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise UserError(f"step returned a {type(out).__name__}, expected a pair (logits [B, T, V], state)")
        B, T = tokens.shape
        if T > 1 and shape_of(first_output(out[0]))[:2] == (B, 1):  # a prompt's last position only (a loop inside?)
            self.last_only = True
            logits = np.full((B, T, self.V), np.nan)  # [B, T, V]: NaN where nothing came back, never compared
            logits[:, -1:] = self.checked_logits("step", out[0], B, 1, self.V)
            return logits, out[1]
        return self.checked_logits("step", out[0], B, T, self.V), out[1]

    def cached(self, model: Any, tokens: np.ndarray, chunks: list[int]) -> np.ndarray:
        state, pieces, start = None, [], 0
        for size in chunks:
            with marked(start):
                logits, state = self.one_step(model, tokens[:, start : start + size], state)
            pieces.append(logits)
            start += size
        return np.concatenate(pieces, axis=1)

    def generate(self, model: Any, prompt: np.ndarray, n: int, mode: str) -> np.ndarray:
        tokens = np.array(prompt, dtype=np.int64)
        if mode == "naive":
            for _ in range(n):
                token = self.full(model, tokens)[:, -1].argmax(-1)[:, None]  # [B, 1]
                tokens = np.concatenate([tokens, token], axis=1)
            return tokens
        logits, state = self.one_step(model, tokens, None)
        for i in range(n):
            token = logits[:, -1].argmax(-1)[:, None]  # [B, 1]
            tokens = np.concatenate([tokens, token], axis=1)
            if i < n - 1:
                logits, state = self.one_step(model, token, state)
        return tokens

    @contextlib.contextmanager
    def counting_forwards(self, model: Any) -> Iterator[list[tuple[tuple[int, ...], float]] | None]:
        if callable(getattr(model, "register_forward_pre_hook", None)):  # a torch module: its hooks see every call
            with hooked(model) as seen:
                yield seen
            return
        calls: list[tuple[tuple[int, ...], float]] = []
        forward = getattr(model, "forward", None)
        if not callable(forward) or isinstance(model, type):
            yield None
            return

        def counted(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            calls.append((shape_of(tokens_of(args, kwargs)), time.perf_counter()))
            return out

        try:
            model.forward = counted  # an instance attribute: model(...) and model.forward(...) both find it
        except (AttributeError, TypeError):
            yield None
            return
        try:
            yield calls
        finally:
            del model.forward

    def prefill_call(self, model: Any, prompt: np.ndarray) -> str:
        self.one_step(model, prompt, None)
        return "step"

    def generators(self) -> tuple[str, ...]:
        return ("naive", "cached")


@contextlib.contextmanager
def hooked(model: Any) -> Iterator[list[tuple[tuple[int, ...], float]]]:
    """A torch module's forward calls while inside: the tokens' shape of each (a positional or a
    keyword argument, input_ids=...) and when it ended."""
    calls: list[tuple[tuple[int, ...], float]] = []
    shapes: list[tuple[int, ...]] = []

    def before(module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        shapes.append(shape_of(tokens_of(args, kwargs)))

    def after(module: Any, args: tuple, kwargs: dict[str, Any], out: Any) -> None:
        calls.append((shapes.pop() if shapes else (), time.perf_counter()))

    handles = [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def load_implementation(target: str | ModuleType) -> Implementation:
    module = import_target(target)
    label = target if isinstance(target, str) else module.__name__
    post = [name for name in POST if callable(getattr(module, name, None))]
    adapter = [name for name in ADAPTER if callable(getattr(module, name, None))]
    if len(adapter) == len(ADAPTER):
        return Adapter(module, label)
    if len(post) == len(POST):
        return Post(module, label)
    if len(adapter) > len(post):
        missing = [name for name in ADAPTER if name not in adapter]
        raise UserError(
            f"{echo_path(label)} has no function {', '.join(missing)} (an adapter defines {', '.join(ADAPTER)})"
        )
    missing = [name for name in POST if name not in post]
    raise UserError(
        f"{echo_path(label)} has no {', '.join(missing)}: define TinyModel, generate_naive and generate_cached "
        f"(the post's interface) or load, full and step (an adapter)"
    )
