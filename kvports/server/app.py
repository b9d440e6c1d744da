"""The FastAPI application: the OpenAI endpoints over the engine's loop.

- `GET /health`, `GET /metrics` (Prometheus' text format), `GET /v1/models`
- `POST /v1/completions`, `POST /v1/chat/completions`: whole, or streamed (`"stream": true`) as
  Server-Sent Events, one `data: {json}` chunk per step's tokens, then `data: [DONE]`

Imported only by `kvports serve`, once it has found FastAPI installed (the `serve` extra).
Every refusal is an OpenAI error object with a 4xx status; an unexpected failure is a 500 with a
one-line message, never a traceback. A client that goes away cancels its request (its blocks go
back before the next step); one whose body does not come within the body timeout is answered
408. At shutdown, `end_requests` ends what still runs with a 503 error object (a stream's last
chunk, then `[DONE]`). With an API key, `/v1/` asks for `Authorization: Bearer KEY`, compared in
constant time. With `--allowed-origins`, Starlette's CORS middleware answers browsers' preflights.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from kvports.batching.request import Request
from kvports.batching.scheduler import TokenLogprobs
from kvports.formats.hf.text import decode
from kvports.server.detokenize import Detokenizer
from kvports.server.loop import Choice, EngineLoop, Job, QueueFull
from kvports.server.metrics import Metrics
from kvports.server.schemas import MAX_BODY_BYTES, ApiError, Chat, Completion, Encode, Limits, check_body, parse_body

RETRY_AFTER_S = 1  # a full queue's advice: most requests finish within seconds
DISCONNECT_POLL_S = 0.25  # how often a request waiting for tokens looks whether its client is still there


@dataclass
class ServerState:
    loop: EngineLoop
    metrics: Metrics
    limits: Limits
    tokenizer: Any  # a tokenizers.Tokenizer, or None (token ids only)
    encode: Encode | None
    chat: Chat | None
    api_key: str | None = None
    created: int = 0  # the model's "created" time, as /v1/models shows it
    describe: str = ""  # the framework, model and context, for the line that says it is ready
    body_timeout: float | None = None  # seconds a request's body may take to arrive (None: no limit)
    allowed_origins: tuple[str, ...] = ()  # the origins a browser page may call from (CORS); none by default
    answers: set[Answer] = field(default_factory=set)  # the requests running now

    def end_requests(self) -> None:
        """End every running request now (the server shuts down): each answers a 503 error object,
        a stream as its last chunk."""
        for answer in self.answers:
            answer.job.events.put_nowait(("shutdown", 0, None))  # after the tokens already made


def create_app(state: ServerState) -> Any:
    app = FastAPI(title="kvports", docs_url=None, redoc_url=None, openapi_url=None)
    if state.allowed_origins:  # a browser asks first (a preflight); without this it gets 405
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(state.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],  # Authorization and Content-Type among them
        )
    add_error_handlers(app)

    def authorize(request: HttpRequest) -> None:
        if state.api_key is None:
            return
        # The header as its bytes (Starlette decodes headers as Latin-1); the scheme's name is
        # case-insensitive (RFC 9110), the key is not. The key is visible ASCII (checked at start).
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip(" ").encode("latin-1"), state.api_key.encode("ascii")
        ):
            raise ApiError(
                401,
                "a valid API key is required: 'Authorization: Bearer KEY'",
                None,
                "invalid_api_key",
                "authentication_error",
            )

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: HttpRequest) -> dict[str, Any]:
        authorize(request)
        model = {"id": state.limits.model, "object": "model", "created": state.created, "owned_by": "kvports"}
        model["max_model_len"] = state.limits.context
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: HttpRequest) -> Any:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: HttpRequest) -> Any:
        return await complete(request, chat=True)

    async def complete(request: HttpRequest, chat: bool) -> Any:
        authorize(request)
        body = parse_body(await read_body(request, state.body_timeout))
        checked = check_body(body, state.limits, chat, state.encode, state.chat)
        job = make_job(checked)
        try:
            state.loop.submit(job)
        except QueueFull as exc:
            state.metrics.rejected.inc()
            raise ApiError(
                429,
                f"the server is busy: {exc}; retry later",
                None,
                "queue_full",
                "rate_limit_error",
                {"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        answer = Answer(state, checked, job, request, str(body["model"]))
        state.answers.add(answer)
        if checked.stream:
            return StreamingResponse(
                answer.stream(),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            return await answer.whole()
        finally:
            state.answers.discard(answer)
            if not answer.done:
                state.loop.cancel(job)

    def make_job(checked: Completion) -> Job:
        request_id = secrets.token_hex(8)
        choices = [
            Choice(
                index,
                Request(
                    f"{request_id}-{index}",
                    checked.prompt,
                    generation,
                    logprobs=checked.logprobs,
                    prompt_logprobs=checked.logprobs if checked.echo else None,
                    response_format=checked.response_format,
                ),
            )
            for index, generation in enumerate(checked.generations)
        ]
        return Job(choices, asyncio.get_running_loop())

    return app


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def add_error_handlers(app: Any) -> None:
    """Every failure answered with the OpenAI error object: ours, Starlette's, FastAPI's, and a 500
    for anything unexpected (its type named, no traceback sent)."""

    @app.exception_handler(ApiError)
    async def api_error(request: HttpRequest, error: ApiError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(request: HttpRequest, error: HTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {error.detail}"
        return error_response(ApiError(error.status_code, message, None, None, kind))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: HttpRequest, error: RequestValidationError) -> JSONResponse:
        return error_response(ApiError(400, "the request is not valid"))

    @app.exception_handler(Exception)
    async def unexpected(request: HttpRequest, error: Exception) -> JSONResponse:
        message = f"the server failed on this request ({type(error).__name__})"
        return error_response(ApiError(500, message, None, None, "server_error"))


async def read_body(request: Any, seconds: float | None) -> bytes:
    """The body, refused (413) past MAX_BODY_BYTES, by its declared length or as it arrives, and
    (408) if it has not all come within `seconds`: a body trickled, or one that never ends."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is {declared} bytes, above {MAX_BODY_BYTES}", None, "body_too_large")

    async def chunks() -> bytes:
        read: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is above {MAX_BODY_BYTES} bytes", None, "body_too_large")
            read.append(chunk)
        return b"".join(read)

    try:
        return await asyncio.wait_for(chunks(), seconds)
    except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
        message = f"the request body did not arrive within {seconds:g} s"
        raise ApiError(408, message, None, "body_timeout", headers={"Connection": "close"}) from None
    except ClientDisconnect:  # nobody reads the answer
        raise ApiError(499, "the client closed the connection") from None


class Answer:
    """One request's answer, built from its job's events: whole, or as Server-Sent Events."""

    def __init__(self, state: ServerState, checked: Completion, job: Job, request: Any, model: str):
        self.state, self.checked, self.job, self.request, self.model = state, checked, job, request, model
        self.id = ("chatcmpl-" if checked.chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        stop_ids = state.limits.stop_ids
        n = len(checked.generations)
        self.text = [Detokenizer(state.tokenizer, checked.stop, stop_ids) for _ in range(n)]
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[TokenLogprobs]] = [[] for _ in range(n)]  # one per token, if asked
        self.offsets = [0] * n  # a completion's text_offset: the characters of its tokens' texts so far
        self.spelled: dict[int, str] = {}  # token id -> its text
        self.finish: list[str | None] = [None] * n
        self.error: ApiError | None = None  # the generation failed, or the server ended it
        self.done = False

    # ---------------------------------------------------------------- events

    async def events(self) -> AsyncIterator[tuple[int, str, str | None]]:
        """(choice, new text, finish reason or None) as the engine makes them; ends when every choice has."""
        while not all(reason is not None for reason in self.finish):
            try:
                event = await asyncio.wait_for(self.job.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await self.request.is_disconnected():
                    self.state.loop.cancel(self.job)
                    return
                continue
            kind, index, value = event
            if kind == "shutdown":
                message = "the server is shutting down: this request ended before it finished"
                self.error = ApiError(503, message, None, "server_shutdown", "server_error")
                self.state.loop.cancel(self.job)
                return
            detokenizer = self.text[index]
            if kind == "tokens":
                ids, logprobs = value
                if self.finish[index] is not None or detokenizer.stopped:
                    continue
                taken = detokenizer.tokens
                piece = detokenizer.add(ids)
                self.tokens[index].extend(ids[: detokenizer.tokens - taken])  # up to a stop string's last token
                self.logprobs[index].extend(logprobs[: detokenizer.tokens - taken])
                if detokenizer.stopped:
                    self.state.loop.stop_choice(self.job, index)
                    self.finish[index] = "stop"
                    yield index, piece + detokenizer.finish(), "stop"
                elif piece:
                    yield index, piece, None
            elif kind == "error":  # the request was good; its generation failed (an overflow, a failed step)
                self.error = ApiError(500, str(value), None, "generation_failed", "server_error")
                self.finish[index] = "error"
                self.state.loop.cancel(self.job)
                return
            elif self.finish[index] is None:  # "finish"
                reason = "stop" if value == "stop" else "length" if value == "length" else str(value)
                self.finish[index] = reason
                yield index, detokenizer.finish(), reason
        self.done = True

    def usage(self) -> dict[str, Any]:
        prompt = len(self.checked.prompt)
        completion = sum(len(tokens) for tokens in self.tokens)
        cached = max((choice.sequence.cached_tokens for choice in self.job.choices if choice.sequence), default=0)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # ---------------------------------------------------------------- whole

    async def whole(self) -> dict[str, Any]:
        texts = [""] * len(self.finish)
        async for index, piece, _ in self.events():
            texts[index] += piece
        if self.error is not None:
            raise self.error
        if not self.done:  # the client went away: nobody reads this
            raise ApiError(499, "the client closed the connection")
        if self.checked.prompt_only:  # max_tokens 0: the one token the engine computed is dropped
            texts = [""] * len(texts)
            self.tokens = [[] for _ in texts]
            self.logprobs = [[] for _ in texts]
            self.finish = ["length"] * len(texts)
        choices = [self.choice(index, text) for index, text in enumerate(texts)]
        kind = "chat.completion" if self.checked.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }

    def choice(self, index: int, text: str) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.checked.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = self.echoed() + text if self.checked.echo else text
        prompt = self.prompt_logprobs(index) if self.checked.echo else None
        choice["logprobs"] = self.logprobs_of(index, 0, len(self.tokens[index]))
        if prompt is not None and choice["logprobs"] is not None:
            choice["logprobs"] = {key: prompt[key] + choice["logprobs"][key] for key in prompt}
        choice["finish_reason"] = self.finish[index]
        choice["seed"] = self.checked.generations[index].seed  # `kvports generate --seed` repeats it
        if self.checked.return_token_ids:
            choice["token_ids"] = self.tokens[index]
        return choice

    # ---------------------------------------------------------------- streamed

    async def stream(self) -> AsyncIterator[str]:
        try:
            if self.checked.chat:
                for index in range(len(self.finish)):
                    yield self.sse(self.chunk(index, {"role": "assistant", "content": ""}, None, [], None))
            sent = [0] * len(self.finish)
            async for index, piece, reason in self.events():
                new = self.tokens[index][sent[index] :]
                logprobs = self.logprobs_of(index, sent[index], len(self.tokens[index]))
                sent[index] = len(self.tokens[index])
                delta = {"content": piece} if self.checked.chat else piece
                if piece or reason is not None or new:
                    empty = {} if self.checked.chat else ""
                    yield self.sse(self.chunk(index, delta if piece else empty, reason, new, logprobs))
            if self.error is not None:
                yield self.sse(self.error.body())
            elif self.done and self.checked.include_usage:
                usage = {
                    "id": self.id,
                    "object": self.kind,
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": self.usage(),
                }
                yield self.sse(usage)
            if self.done or self.error is not None:
                yield "data: [DONE]\n\n"
        finally:
            self.state.answers.discard(self)
            if not self.done:
                self.state.loop.cancel(self.job)

    @property
    def kind(self) -> str:
        return "chat.completion.chunk" if self.checked.chat else "text_completion"

    def chunk(
        self, index: int, delta: Any, reason: str | None, token_ids: list[int], logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.checked.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        choice["logprobs"] = logprobs
        choice["finish_reason"] = reason
        choice["seed"] = self.checked.generations[index].seed
        if self.checked.return_token_ids:
            choice["token_ids"] = token_ids
        chunk = {"id": self.id, "object": self.kind, "created": self.created, "model": self.model, "choices": [choice]}
        if self.checked.include_usage:
            chunk["usage"] = None
        return chunk

    @staticmethod
    def sse(data: dict[str, Any]) -> str:
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    # ---------------------------------------------------------------- log-probabilities

    def logprobs_of(self, index: int, start: int, end: int) -> dict[str, Any] | None:
        """Choice `index`'s tokens start..end in the OpenAI wire format, as vLLM writes it (None unless
        asked): a chat's {"content": [{token, logprob, bytes, top_logprobs}]}, a completion's legacy
        {tokens, token_logprobs, top_logprobs (token -> logprob), text_offset}. A log-probability
        that underflowed to -inf is written -9999.0, as vLLM does: JSON has no infinity."""
        if self.checked.logprobs is None:
            return None
        steps = self.logprobs[index][start:end]
        if self.checked.chat:
            return {
                "content": [{**self.spell(step.token, step.logprob), "top_logprobs": self.top(step)} for step in steps]
            }
        tokens = [self.text_of(step.token) for step in steps]
        offsets = self.text_offsets(index, tokens)
        return {
            "tokens": tokens,
            "token_logprobs": [finite(step.logprob) for step in steps],
            "top_logprobs": [self.top_by_text(step) for step in steps],
            "text_offset": offsets,
        }

    def text_offsets(self, index: int, tokens: list[str]) -> list[int]:
        """Where each of `tokens` begins in choice `index`'s text so far (the legacy `text_offset`), the
        choice's running offset moved past them."""
        offsets = []
        for token in tokens:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(token)
        return offsets

    def echoed(self) -> str:
        """The prompt's text, as `echo` begins a completion with it (vLLM's: its ids decoded)."""
        tokenizer = self.state.tokenizer
        return "" if tokenizer is None else decode(tokenizer, list(self.checked.prompt))

    def prompt_logprobs(self, index: int) -> dict[str, Any] | None:
        """The prompt's own log-probabilities in the legacy format, as vLLM echoes them: every prompt
        token, the first's log-probability and likeliest tokens null (nothing comes before it),
        offsets from 0; the completion's offsets then continue after the prompt's."""
        if self.checked.logprobs is None:
            return None
        sequence = self.job.choices[index].sequence
        assert sequence is not None  # the engine made it before any token came
        steps = sequence.prompt_logprobs  # one per prompt token after the first
        tokens = [self.text_of(token) for token in self.checked.prompt]
        offsets = self.text_offsets(index, tokens)
        return {
            "tokens": tokens,
            "token_logprobs": [None] + [finite(step.logprob) for step in steps],
            "top_logprobs": [None] + [self.top_by_text(step) for step in steps],
            "text_offset": offsets,
        }

    def top_by_text(self, step: TokenLogprobs) -> dict[str, float]:
        """The legacy format's {text: logprob} of a step's likeliest tokens; where two ids spell the
        same text, the likelier one's."""
        found: dict[str, float] = {}
        for token, logprob in step.top:
            found.setdefault(self.text_of(token), finite(logprob))
        return found

    def top(self, step: TokenLogprobs) -> list[dict[str, Any]]:
        return [self.spell(token, logprob) for token, logprob in step.top]

    def spell(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.text_of(token)
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8", "replace"))}

    def text_of(self, token: int) -> str:
        """A token's own text (special tokens spelled out, as `generate --logprobs` shows them), or,
        without a tokenizer, "token_id:ID" (vLLM's spelling)."""
        if token not in self.spelled:
            tokenizer = self.state.tokenizer
            self.spelled[token] = f"token_id:{token}" if tokenizer is None else decode(tokenizer, [token])
        return self.spelled[token]


def finite(logprob: float) -> float:
    return max(logprob, -9999.0)
