"""`kvports serve` as a server people trust: a client that goes away frees its blocks, a full queue
says 429 with Retry-After, an API key is asked for (and one no client could send is refused), an
overflowing forward ends its request alone, SIGINT and SIGTERM end the process cleanly (every
running stream with its last chunk; a second signal at once), a port another server holds is one
error line, and without the serve extra it says what to install."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys

import pytest

from kvports.commands import serve
from kvports.commands.serve import INSTALL
from tests.helpers.commands import assert_one_error_line, run_cli, running
from tests.helpers.servers import WAIT_S, OverflowingPort, SlowPort, metric, start_process, start_server, wait_for

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
STEP_S = 0.05  # a slowed step: a 40-token answer takes two seconds
CANCELLED = 'kvports_requests_finished_total{finish_reason="cancelled"}'
LONG = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 40, "temperature": 0}
# A stream no wait here outlasts: 60 tokens (the tiny model's greedy answer holds no end-of-turn
# id) of 0.5 s steps take 30 s, so it ends sooner only if the server ends it.
ENDLESS_STEP_S = 0.5
ENDLESS = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 60, "temperature": 0, "stream": True}
KEY = "s3cret"


@pytest.fixture(scope="module")
def slow_server(chat_model):
    """Two rows at most, one more waiting, every step 50 ms."""
    argv = ("--framework", "numpy", "--weights", chat_model, "--max-batch", "2", "--max-queue", "1")
    running = start_server(*argv, wrap_port=lambda port: SlowPort(port, STEP_S))
    yield running
    running.stop()


def metrics(server) -> str:
    return httpx.get(server.url + "/metrics", timeout=WAIT_S).text


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(slow_server):
    cancelled = metric(metrics(slow_server), CANCELLED, default=0.0)
    with httpx.stream(
        "POST", slow_server.url + "/v1/completions", json={**LONG, "stream": True}, timeout=WAIT_S
    ) as answer:
        lines = answer.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # a token came: it runs
        assert metric(metrics(slow_server), "kvports_kv_blocks_used") > 0
    # The connection is closed: within a few steps the request is cancelled and its blocks free.
    assert wait_for(lambda: metric(metrics(slow_server), "kvports_kv_blocks_used") == 0, 20 * STEP_S + 2)
    text = metrics(slow_server)
    assert metric(text, CANCELLED) == cancelled + 1
    assert metric(text, "kvports_kv_blocks_free") == slow_server.engine.blocks.num_blocks
    assert metric(text, "kvports_requests_running") == 0


def test_a_full_queue_is_429_with_retry_after_and_the_rest_finish(slow_server):
    """Two running and one waiting fill it: a fourth request is refused, not queued without bound."""

    async def everyone():
        async with httpx.AsyncClient(timeout=WAIT_S) as api:
            url = slow_server.url + "/v1/completions"
            first = [asyncio.create_task(api.post(url, json=LONG)) for _ in range(3)]
            assert await asyncio.to_thread(wait_for, lambda: slow_server.state.loop.in_flight == 3, WAIT_S)
            refused = await api.post(url, json=LONG)
            return refused, await asyncio.gather(*first)

    refused, answers = asyncio.run(everyone())
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert [answer.status_code for answer in answers] == [200, 200, 200]


def test_a_row_whose_logits_overflow_ends_alone_with_an_error(chat_model):
    marker = 250
    server = start_server(
        "--framework", "numpy", "--weights", chat_model, wrap_port=lambda port: OverflowingPort(port, marker)
    )
    try:
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=WAIT_S)

        async def both():
            async with httpx.AsyncClient(timeout=WAIT_S) as client:
                url = server.url + "/v1/completions"
                body = {"model": "tiny", "max_tokens": 6, "temperature": 0}
                return await asyncio.gather(
                    client.post(url, json={**body, "prompt": [5, marker, 7]}),
                    client.post(url, json={**body, "prompt": [5, 6, 7]}),
                )

        failed, fine = asyncio.run(both())
        assert failed.status_code == 500
        assert "overflowed float32" in failed.json()["error"]["message"]
        assert fine.status_code == 200 and fine.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert api.completions.create(model="tiny", prompt=[9, 9], max_tokens=2).choices[0].text is not None
        assert server.engine.blocks.num_free == server.engine.blocks.num_blocks
    finally:
        server.stop()


@pytest.fixture(scope="module")
def keyed_server(chat_model):
    running = start_server("--framework", "numpy", "--weights", chat_model, "--api-key", KEY)
    yield running
    running.stop()


def test_an_api_key_is_asked_for_and_checked(keyed_server):
    body = {"model": "tiny", "prompt": [1, 2], "max_tokens": 1}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}, {"authorization": f"Basic {KEY}"}):
        answer = httpx.post(keyed_server.url + "/v1/completions", json=body, headers=headers, timeout=WAIT_S)
        assert answer.status_code == 401, headers
        assert answer.json()["error"]["code"] == "invalid_api_key"
    api = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=KEY, max_retries=0, timeout=WAIT_S)
    assert [model.id for model in api.models.list()] == ["tiny"]
    assert httpx.get(keyed_server.url + "/health", timeout=WAIT_S).json() == {"status": "ok"}


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_bearer_scheme_is_case_insensitive(keyed_server, scheme):
    """RFC 9110: an authentication scheme's name is case-insensitive."""
    answer = httpx.get(keyed_server.url + "/v1/models", headers={"authorization": f"{scheme} {KEY}"}, timeout=WAIT_S)
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("key", ["cl\u00e9", "tab\tkey", "bell\x07", "two words"])
def test_an_api_key_no_client_could_send_is_refused_at_start(capsys, chat_model, no_port_may_load, key):
    """A header carries visible ASCII: with any other character in the key no client could authenticate."""
    argv = ("serve", "--framework", "numpy", "--weights", chat_model, "--api-key", key, "--port", "0")
    err = assert_one_error_line(*run_cli(capsys, *argv))
    assert err.startswith("error: the API key (--api-key or $KVPORTS_API_KEY) holds"), err
    assert key not in err  # a secret is not written to a log


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_the_server_cleanly_and_leaves_no_process(chat_model, sig):
    process, url = start_process("--framework", "numpy", "--weights", chat_model)
    try:
        answer = httpx.post(
            url + "/v1/completions", json={"model": "tiny", "prompt": [3, 4], "max_tokens": 2}, timeout=WAIT_S
        )
        assert answer.status_code == 200
        process.send_signal(sig)
        out, err = process.communicate(timeout=WAIT_S)
        assert process.returncode == 0, err
        assert "Traceback" not in err
        assert running([process.pid]) == []
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=WAIT_S)


def stream_and_signal(process, url: str, signals: list[signal.Signals]) -> list[str]:
    """The data lines of an endless stream, the signals sent to the server once its first token came
    (each after the last one has made the server stop accepting connections: two at once could
    reach the process as one)."""
    with httpx.stream("POST", url + "/v1/completions", json=ENDLESS, timeout=WAIT_S) as answer:
        lines = answer.iter_lines()
        data = [next(line for line in lines if line.startswith("data:"))]
        for number, sig in enumerate(signals):
            if number:
                assert wait_for(lambda: refused(url)), "the server still accepts connections after a signal"
            process.send_signal(sig)
        data += [line for line in lines if line.startswith("data:")]
    return data


def refused(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def assert_ended_by_the_shutdown(data: list[str], process) -> None:
    """The stream's text chunks, then an error chunk that says the server shut down, then [DONE];
    the process gone with status 0 and no traceback."""
    out, err = process.communicate(timeout=WAIT_S)
    assert data[-1] == "data: [DONE]", data[-3:]
    error = json.loads(data[-2].removeprefix("data: "))["error"]
    assert (error["code"], error["type"]) == ("server_shutdown", "server_error"), error
    chunks = [json.loads(line.removeprefix("data: ")) for line in data[:-2]]
    assert chunks and all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks)
    assert process.returncode == 0, err
    assert "Traceback" not in err and "CancelledError" not in err, err
    assert running([process.pid]) == []


def test_a_stream_running_past_the_grace_period_ends_with_an_error_chunk_and_done(chat_model):
    argv = ("--framework", "numpy", "--weights", chat_model, "--shutdown-timeout", "0.5")
    process, url = start_process(*argv, step_s=ENDLESS_STEP_S)
    try:
        assert_ended_by_the_shutdown(stream_and_signal(process, url, [signal.SIGTERM]), process)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=WAIT_S)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_ends_the_server_at_once_each_stream_with_its_last_chunk(chat_model, sig):
    """The grace period (60 s) and the stream (30 s) outlast the test's wait: only the second signal ends them."""
    argv = ("--framework", "numpy", "--weights", chat_model, "--shutdown-timeout", "60")
    process, url = start_process(*argv, step_s=ENDLESS_STEP_S)
    try:
        assert_ended_by_the_shutdown(stream_and_signal(process, url, [sig, sig]), process)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=WAIT_S)


def test_without_the_serve_extra_it_says_what_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # an import of it fails, as where it is not installed
    assert assert_one_error_line(*run_cli(capsys, "serve", "--framework", "numpy")) == f"error: {INSTALL}\n"


def test_metrics_show_the_tokens_and_the_latencies(slow_server):
    before = metrics(slow_server)
    answer = httpx.post(slow_server.url + "/v1/completions", json={**LONG, "max_tokens": 3}, timeout=WAIT_S)
    assert answer.status_code == 200
    usage = answer.json()["usage"]
    after = metrics(slow_server)
    for name, grown in [
        ("kvports_prompt_tokens_total", usage["prompt_tokens"]),
        ("kvports_generation_tokens_total", usage["completion_tokens"]),
        ("kvports_time_to_first_token_seconds_count", 1),
        ("kvports_inter_token_latency_seconds_count", usage["completion_tokens"] - 1),
    ]:
        assert metric(after, name) - metric(before, name) == grown, name
    assert json.loads(httpx.get(slow_server.url + "/v1/models", timeout=WAIT_S).text)["data"][0]["id"] == "tiny"


def test_a_port_in_use_is_one_error_line_before_any_model_loads(capsys, chat_model, no_port_may_load):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ("serve", "--framework", "numpy", "--weights", chat_model, "--port", port)
        err = assert_one_error_line(*run_cli(capsys, *argv))
    assert err == f"error: cannot listen on 127.0.0.1:{port} (Address already in use)\n"


def test_a_second_server_on_the_port_of_one_still_loading_is_one_error_line(capsys, chat_model, no_port_may_load):
    """Two servers started at once: the first holds its socket (from serve.listen) while its model
    loads; the second is refused at once, before its own model loads."""
    with serve.listen("127.0.0.1", 0) as first:
        port = first.getsockname()[1]
        argv = ("serve", "--framework", "numpy", "--weights", chat_model, "--port", port)
        err = assert_one_error_line(*run_cli(capsys, *argv))
    assert err == f"error: cannot listen on 127.0.0.1:{port} (Address already in use)\n"
