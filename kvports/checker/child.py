"""The child process isolate.py starts (its CHILD: child_main(REQUESTS, REPLIES)): it imports
the implementation and answers the checker's requests, one JSON line each (wire.py), on the
pipes REQUESTS and REPLIES. It runs the driver (plugin.py) only: each request is one call of the
implementation's code, each reply the values it returned ({"value": ...}), the error it raised
({"error": {...}}) or why it cannot be used ({"user_error": "..."}). It compares nothing and
decides nothing: the checks, their rows and the exit status are the parent's.

  {"op": "load", "target": T}                       -> {"kind", "framework", "full_name", "step_name"}
  {"op": "build", "config": {...}, "weights": {name: array}, "dtype": D}   -> model number
  {"op": "full", "model": M, "tokens": array}       -> {"logits": array}
  {"op": "step", "model": M, "tokens": array, "state": S or None}   -> {"logits": array, "state": S}
  {"op": "generate", "model": M, "prompt": array, "n": N, "mode": "naive" or "cached"}   -> {"tokens": array}
  {"op": "prefill", "model": M, "prompt": array}    -> {"function": F, "calls": [[shape, seconds], ...] or None}
  {"op": "can_step" | "training" | "to_eval", "model": M}   -> true or false (to_eval: null)
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from kvports.checker import wire
from kvports.checker.plugin import Driver, ImplementationError, load_implementation
from kvports.shared.config import ModelConfig
from kvports.shared.errors import UserError


class Server:
    def __init__(self) -> None:
        self.driver: Driver | None = None
        self.models: list[Any] = []
        self.state: Any = None  # the one cache being filled: a cached run or a generator uses one at a time
        self.states = 0  # how many caches were started: a state number names the latest

    def answer(self, request: dict[str, Any]) -> Any:
        op = request["op"]
        if op == "load":
            self.driver = load_implementation(request["target"])
            return {name: getattr(self.driver, name) for name in ("kind", "framework", "full_name", "step_name")}
        driver = self.driver
        assert driver is not None
        if op == "build":
            weights = {name: array(spec) for name, spec in request["weights"].items()}
            config = request["config"]
            fields = {**config, "eos_token_ids": tuple(config["eos_token_ids"])}  # JSON has no tuple
            self.models.append(driver.build(ModelConfig(**fields), weights, request["dtype"]))
            return len(self.models) - 1
        model = self.models[request["model"]]
        if op == "full":
            return {"logits": wire.pack(*driver.full(model, array(request["tokens"])))}
        if op == "step":
            state = None if request["state"] is None else self.state
            logits, low, self.state = driver.step(model, array(request["tokens"]), state)
            self.states += request["state"] is None
            return {"logits": wire.pack(logits, low), "state": self.states}
        if op == "generate":
            tokens = driver.generate(model, array(request["prompt"]), request["n"], request["mode"])
            return {"tokens": wire.pack(tokens)}
        if op == "prefill":
            function, calls = driver.prefill(model, array(request["prompt"]))
            return {"function": function, "calls": calls}
        return getattr(driver, op)(model)  # can_step, training, to_eval


def array(spec: dict[str, Any]) -> np.ndarray:
    return wire.unpack(spec, "an input")[0]


def child_main(argv: list[str]) -> int:
    requests, replies = os.fdopen(int(argv[0]), "rb"), os.fdopen(int(argv[1]), "wb")
    server = Server()
    replies.write(wire.encode({"value": "ready"}))
    replies.flush()
    for line in requests:
        request = wire.decode(line)
        try:
            reply = {"value": server.answer(request)}
        except ImplementationError as error:
            reply = {"error": error.as_dict()}
        except UserError as error:
            reply = {"user_error": str(error)}
        except BaseException as error:  # the implementation's code outside a call (its model's state_dict, modules)
            reply = {"error": ImplementationError.caught(request["op"], error).as_dict()}
        replies.write(wire.encode(reply))
        replies.flush()
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
