"""kvports' own NumPy port behind kvports check's adapter interface, through its public
functions only: a model of any family, at the weights' dtype. Its "cache" is the history
itself (each step recomputes it with forward_chunks): correct, and slow on purpose of nothing
but brevity."""

import numpy as np

from kvports.registry import load_port
from kvports.shared.config import ModelConfig

port = load_port("numpy")


def load(config, weights):
    dtype = str(next(iter(weights.values())).dtype)
    return port.load_model(ModelConfig.from_dict(config), weights, dtype)


def full(model, tokens):
    return port.forward_chunks(model, tokens, [tokens.shape[1]])


def step(model, tokens, state):
    history, chunks = (
        (tokens, [tokens.shape[1]])
        if state is None
        else (np.concatenate([state[0], tokens], axis=1), [*state[1], tokens.shape[1]])
    )
    logits = port.forward_chunks(model, history, chunks)
    return logits[:, -tokens.shape[1] :], (history, chunks)
