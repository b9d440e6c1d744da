"""Loading an implementation to check, in either of its two interfaces, behind one driver.

- The post's interface: a Python file defining a PyTorch `TinyModel` (the seed's parameter
  names), `generate_naive(model, prompt, n)` and `generate_cached(model, prompt, n)`; its
  `forward(idx)` or `forward(idx, caches)`, caches a list of one dict per block that the model
  fills, returning logits [B, T, V] (or a tuple whose first item they are).
- The adapter: a module or file with `load(config: dict, weights: dict[str, ndarray])`,
  `full(model, tokens [B, T]) -> logits [B, T, V]` and
  `step(model, tokens [B, T], state) -> (logits [B, T, V], state)` (state None: a new cache).

A file is imported under a private module name, so its `if __name__ == "__main__":` block
does not run. A driver (Post, Adapter) is the only code that calls the implementation's: each
of its methods makes one call (building the post's model: two) and returns values only (NumPy
arrays, booleans, names), or raises ImplementationError (the implementation raised) or
UserError (it cannot be used). The checks (implementation.py) hold those values to what they
must be; under `kvports check` the driver runs in a child process (child.py) and only its
values come back.
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

from kvports.checker.wire import LOW_PRECISION, Malformed
from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError, echo, echo_path

POST = ("TinyModel", "generate_naive", "generate_cached")
ADAPTER = ("load", "full", "step")
# What an exception is, as the checks tell them apart (SystemExit, KeyboardInterrupt, MemoryError, a
# RuntimeError or ValueError (a shape), another Exception, another BaseException).
CATEGORIES = ("exit", "interrupt", "memory", "value", "error", "other")
MAX_TEXT = 300  # characters of an implementation's text (an exception's message) a line shows
_imported = 0  # a private module name per file imported


def printable(text: str, limit: int = MAX_TEXT) -> str:
    """Text the implementation chose, as a terminal may show it: every character that is not printable
    (an escape sequence's ESC, a carriage return, a lone surrogate) escaped as Python writes it (\\x1b),
    at most `limit` characters."""
    text = text[: limit * 2]
    escaped = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return escaped[:limit]


def one_line(error: BaseException) -> str:
    if isinstance(error, SystemExit):
        return f"exit status {error.code!r}" if not isinstance(error.code, str) else printable(error.code)
    try:
        text = str(error)
    except Exception:  # an exception whose __str__ raises
        text = ""
    return printable(" ".join(text.split())) or printable(type(error).__name__)


def category(error: BaseException) -> str:
    kinds: tuple[type | tuple[type, ...], ...] = (SystemExit, KeyboardInterrupt, MemoryError)
    kinds += ((RuntimeError, ValueError), Exception, BaseException)
    return next(name for name, kind in zip(CATEGORIES, kinds, strict=True) if isinstance(error, kind))


class ImplementationError(Exception):
    """The implementation raised while a check ran it: which function, the exception's type, message
    and the implementation's own line (file:line), and what it is (CATEGORIES); a hint. Plain
    values, so that it crosses from the child process to the checker as it is."""

    def __init__(self, function: str, kind: str, message: str, line: str = "", what: str = "error"):
        self.function, self.kind, self.message, self.line, self.what = function, kind, message, line, what
        self.after_first_chunk = False
        super().__init__(f"{function} raised {kind}: {message}")

    @classmethod
    def caught(cls, function: str, error: BaseException) -> ImplementationError:
        frames = [frame for frame in traceback.extract_tb(error.__traceback__) if "kvports" not in frame.filename]
        line = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
        return cls(function, printable(type(error).__name__), one_line(error), printable(line), category(error))

    def as_dict(self) -> dict[str, str]:
        names = ("function", "kind", "message", "line", "what")
        return {name: getattr(self, name) for name in names}

    @classmethod
    def received(cls, record: Any) -> ImplementationError:
        """The error a child process sent, its text escaped again (it is the implementation's to choose)."""
        names = ("function", "kind", "message", "line", "what")
        texts = (
            isinstance(record, dict) and set(record) == set(names) and all(isinstance(record[n], str) for n in names)
        )
        if not texts:
            raise Malformed("an error that is not {function, kind, message, line, what} as text")
        if record["what"] not in CATEGORIES:
            raise Malformed(f"an error of no known kind ({printable(record['what'], 40)})")
        function, kind, message, line = (printable(record[name]) for name in names[:4])
        return cls(function, kind, message, line, record["what"])

    @property
    def cache_like(self) -> bool:
        """An error a cache that grows wrong raises on the call after the prefill (a cat along the wrong
        axis, an index past a buffer); not an exit, an interrupt or an allocation."""
        return self.what in ("value", "error")

    def hint(self) -> str:
        message = self.message
        if "Sizes of tensors must match except in dimension 0" in message or "must have same number of dim" in message:
            return "torch.cat joins along dim 0 unless told; a new token [B, 1] joins the history [B, T] with dim=1"
        if "'NoneType' object has no attribute" in message:
            return "the naive path passes no cache: check for None before using one"
        if self.what == "value" and ("size" in message or "shape" in message):
            return "a shape that fits the first call but not the next: check how the cache grows"
        if self.what == "exit":
            return "a function under check must return its result, not end the process (sys.exit, exit(), quit())"
        if self.what == "interrupt":
            return "the implementation raised KeyboardInterrupt itself; a checked function must return"
        if self.what == "memory":
            return "an allocation far larger than the model needs: check the shapes of the buffers it makes"
        return "run the function by hand on this input to see the traceback"


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


def logits_of(function: str, out: Any) -> tuple[np.ndarray, str]:
    """A forward's logits as NumPy, and the 16-bit type they came in ("" for none)."""
    raw = first_output(out)
    try:
        return to_numpy(raw), dtype_name(raw) if dtype_name(raw) in LOW_PRECISION else ""
    except Exception as error:  # not an array of any kind
        kind = printable(type(raw).__name__)
        raise UserError(f"{function} returned a {kind}, not logits: {one_line(error)}") from None


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
        try:
            with on_path(str(path.resolve().parent)):  # its own folder, as `python FILE` has: siblings import
                spec.loader.exec_module(module)
        except SyntaxError as exc:
            del sys.modules[name]
            message = printable(str(exc.msg))
            raise UserError(f"cannot import {echo_path(target)}: line {exc.lineno}: {message}") from None
        except BaseException as exc:
            del sys.modules[name]
            kind = printable(type(exc).__name__)
            raise UserError(f"cannot import {echo_path(target)}: {kind}: {one_line(exc)}") from None
        return module
    try:
        with on_path(os.getcwd()):  # a console script's path lacks the folder it runs in
            return importlib.import_module(target)
    except SyntaxError as exc:
        raise UserError(f"cannot import {echo(target)}: line {exc.lineno}: {printable(str(exc.msg))}") from None
    except BaseException as exc:
        raise UserError(f"cannot import {echo(target)}: {printable(type(exc).__name__)}: {one_line(exc)}") from None


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


def call(function: str, fn: Callable[..., Any], *args: Any) -> Any:
    """The implementation's own code runs only through here: whatever it raises (SystemExit and
    KeyboardInterrupt included) is its verdict."""
    try:
        return fn(*args)
    except UserError:
        raise
    except BaseException as exc:
        raise ImplementationError.caught(function, exc) from exc


def loaded_torch(label: str) -> ModuleType:
    """The torch the post's file imported. shared imports no framework of its own: it drives
    the one the implementation brought, so it never loads torch where nothing else did."""
    torch = sys.modules.get("torch")
    if torch is None:
        raise UserError(f"{echo_path(label)} defines TinyModel without importing torch (the post's interface is torch)")
    return torch


def has_dropout(model: Any) -> bool:
    modules = getattr(model, "modules", None)
    if modules is None:
        return True
    return any(type(m).__name__.startswith("Dropout") and getattr(m, "p", 0) > 0 for m in modules())


Calls = list[tuple[tuple[int, ...], float]]  # a forward call's tokens shape, and when it ended (seconds)


class Driver:
    """The implementation's functions, one call per method, values out. NumPy in."""

    kind = ""
    framework = ""  # "torch" where the implementation is a torch module (the reference is then torch's)
    full_name = step_name = ""  # what the checks call the full forward and the cached one

    def __init__(self, module: ModuleType, label: str):
        self.module, self.label = module, label

    def build(self, config: ModelConfig, weights: dict[str, np.ndarray], dtype: str) -> Any:
        raise NotImplementedError

    def full(self, model: Any, tokens: np.ndarray) -> tuple[np.ndarray, str]:
        """Logits (unchecked: implementation.py checks them) and their 16-bit type, as logits_of."""
        raise NotImplementedError

    def step(self, model: Any, tokens: np.ndarray, state: Any) -> tuple[np.ndarray, str, Any]:
        """One cached call: state None starts a new cache; the logits, their 16-bit type, the next state."""
        raise NotImplementedError

    def generate(self, model: Any, prompt: np.ndarray, n: int, mode: str) -> np.ndarray:
        """What the post's generator returned, as an array (the adapter's generators are loops over full and step)."""
        raise NotImplementedError

    def can_step(self, model: Any) -> bool:
        return True

    def training(self, model: Any) -> bool:
        return bool(getattr(model, "training", False)) and has_dropout(model)

    def to_eval(self, model: Any) -> None:
        pass

    def prefill(self, model: Any, prompt: np.ndarray) -> tuple[str, Calls | None]:
        """The cached path's prefill on prompt [B, P] (and its first token): which function ran, and the
        model's forward calls meanwhile (None where they cannot be seen from outside), timed from its start."""
        start = time.perf_counter()
        with self.counting_forwards(model) as calls:
            function = self.prefill_call(model, prompt)
        return function, None if calls is None else [(shape, end - start) for shape, end in calls]

    @contextlib.contextmanager
    def counting_forwards(self, model: Any) -> Iterator[Calls | None]:
        yield None

    def prefill_call(self, model: Any, prompt: np.ndarray) -> str:
        raise NotImplementedError


class Post(Driver):
    """The post's file: a torch TinyModel and its two generators."""

    kind = "post"
    framework = "torch"
    full_name = step_name = "TinyModel.forward"

    def build(self, config: ModelConfig, weights: dict[str, np.ndarray], dtype: str) -> Any:
        torch = loaded_torch(self.label)
        model = call("TinyModel()", self.module.TinyModel)
        if not isinstance(model, torch.nn.Module):
            name = printable(type(model).__name__)
            raise UserError(f"TinyModel() in {echo_path(self.label)} is a {name}, not a torch.nn.Module")
        found = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
        check_names({name: array.shape for name, array in weights.items()}, found, "TinyModel")
        model = model.to(getattr(torch, dtype))
        call(
            "TinyModel.load_state_dict",
            model.load_state_dict,
            {k: torch.from_numpy(np.array(v)) for k, v in weights.items()},
        )
        self.blocks = len(getattr(model, "blocks", [])) or config.n_layers
        return model

    def run_forward(self, model: Any, tokens: np.ndarray, caches: list | None) -> tuple[np.ndarray, str]:
        """forward(idx, caches) as the post calls it: caches a list of one dict per block for the
        cached path; for the full forward a list of None per block (the post's generate_naive), or
        nothing where forward's second parameter has a default."""
        torch = loaded_torch(self.label)
        if caches is None and self.caches_required(model):
            caches = [None] * self.blocks
        with torch.no_grad():
            idx = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
            args = (idx,) if caches is None else (idx, caches)
            out = call(f"{printable(type(model).__name__)}.forward", model, *args)
        return logits_of(self.full_name, out)

    def full(self, model: Any, tokens: np.ndarray) -> tuple[np.ndarray, str]:
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

    def step(self, model: Any, tokens: np.ndarray, state: Any) -> tuple[np.ndarray, str, Any]:
        caches = [{} for _ in range(self.blocks)] if state is None else state
        return (*self.run_forward(model, tokens, caches), caches)

    def generate(self, model: Any, prompt: np.ndarray, n: int, mode: str) -> np.ndarray:
        torch = loaded_torch(self.label)
        name = f"generate_{mode}"
        with torch.no_grad():
            out = call(name, getattr(self.module, name), model, torch.from_numpy(np.asarray(prompt, np.int64)), n)
        return to_numpy(out[0] if isinstance(out, (tuple, list)) else out)

    @contextlib.contextmanager
    def counting_forwards(self, model: Any) -> Iterator[Calls | None]:
        with hooked(model) as calls:
            yield calls

    def prefill_call(self, model: Any, prompt: np.ndarray) -> str:
        torch = loaded_torch(self.label)
        with torch.no_grad():
            idx = torch.from_numpy(np.asarray(prompt, np.int64))
            call("generate_cached", self.module.generate_cached, model, idx, 1)
        return "generate_cached"

    def to_eval(self, model: Any) -> None:
        model.eval()


class Adapter(Driver):
    """load / full / step, any framework."""

    kind = "adapter"
    full_name, step_name = "full", "step"

    def __init__(self, module: ModuleType, label: str):
        super().__init__(module, label)
        self.framework = "torch" if "torch" in sys.modules and self._uses_torch(module) else "other"

    @staticmethod
    def _uses_torch(module: ModuleType) -> bool:
        return any(getattr(value, "__name__", "") == "torch" for value in vars(module).values())

    def build(self, config: ModelConfig, weights: dict[str, np.ndarray], dtype: str) -> Any:
        given = dataclasses.asdict(config)
        given["ffn_hidden"], given["n_kv_heads"] = config.ffn_dim, config.kv_heads  # filled in: no guessing
        return call("load", self.module.load, given, {k: v.copy() for k, v in weights.items()})

    def full(self, model: Any, tokens: np.ndarray) -> tuple[np.ndarray, str]:
        return logits_of("full", call("full", self.module.full, model, np.array(tokens, dtype=np.int64)))

    def step(self, model: Any, tokens: np.ndarray, state: Any) -> tuple[np.ndarray, str, Any]:
        out = call("step", self.module.step, model, np.array(tokens, dtype=np.int64), state)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            name = printable(type(out).__name__)
            raise UserError(f"step returned a {name}, expected a pair (logits [B, T, V], state)")
        return (*logits_of("step", out[0]), out[1])

    @contextlib.contextmanager
    def counting_forwards(self, model: Any) -> Iterator[Calls | None]:
        if callable(getattr(model, "register_forward_pre_hook", None)):  # a torch module: its hooks see every call
            with hooked(model) as seen:
                yield seen
            return
        calls: Calls = []
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
        call("step", self.module.step, model, np.array(prompt, dtype=np.int64), None)
        return "step"


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


def load_implementation(target: str | ModuleType) -> Driver:
    """The driver for an implementation (a file path, a module name or a module); UserError where it
    has neither interface."""
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
