"""lm-eval's own `local-completions` model, in this process, against `kvports serve`: the requests
it builds (token ids, `echo`, `logprobs: 1`, `max_tokens: 1`, a seed) are taken, and the
log-likelihood it parses from our answer is the model's own, a full forward's in float64 to 1e-9.
Slow, and skipped where lm-eval is not installed (the `eval` extra; `make eval` runs the real
model's evaluation, tools/eval_ports.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvports.cli import main
from kvports.registry import PORTS
from tests.helpers.servers import start_exact_server

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

CONTEXT, CONTINUATIONS = "Question: What do bees make?\nAnswer:", (" honey", " milk", " a long answer of words")


@pytest.fixture(scope="module")
def tokenizer(chat_model, tmp_path_factory):
    """The tiny model's GGUF tokenizer as the Hugging Face directory lm-eval loads."""
    folder = tmp_path_factory.mktemp("lm-eval") / "tokenizer"
    assert main(["convert", "--from-gguf", str(chat_model), "--tokenizer-out", str(folder)]) == 0
    return folder


@pytest.fixture(scope="module", params=PORTS)
def server(request, chat_model):
    running = start_exact_server(request.param, chat_model)
    yield running
    running.stop()


def lm_evals_model(server, tokenizer):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(
        base_url=f"{server.url}/v1/completions",
        model="tiny",
        tokenizer=str(tokenizer),
        tokenizer_backend="huggingface",
        tokenized_requests=True,
        num_concurrent=1,
        max_retries=1,
    )


def full_forward_loglikelihood(server, context: list[int], continuation: list[int]) -> float:
    """The continuation's summed log-probability from the port's own full forward, float64."""
    engine = server.engine
    tokens = context + continuation
    logits = np.asarray(engine.port.forward_chunks(engine.model, np.asarray([tokens]), [len(tokens)]))[0]  # [T, V]
    shifted = logits - logits.max(axis=-1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))  # [T, V]
    return float(sum(logprobs[len(context) + index - 1, token] for index, token in enumerate(continuation)))


def test_lm_evals_loglikelihoods_are_the_models_own(server, tokenizer):
    from lm_eval.api.instance import Instance

    model = lm_evals_model(server, tokenizer)
    requests = [
        Instance("loglikelihood", doc={}, arguments=(CONTEXT, continuation), idx=index)
        for index, continuation in enumerate(CONTINUATIONS)
    ]
    answers = model.loglikelihood(requests, disable_tqdm=True)
    context = model.tok_encode(CONTEXT)
    for continuation, (loglikelihood, _) in zip(CONTINUATIONS, answers, strict=True):
        whole = model.tok_encode(CONTEXT + continuation)
        assert whole[: len(context)] == context  # the continuation starts a token of its own
        expected = full_forward_loglikelihood(server, context, whole[len(context) :])
        assert abs(loglikelihood - expected) < 1e-9, (continuation, loglikelihood, expected)
