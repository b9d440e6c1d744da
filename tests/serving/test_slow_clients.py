"""A client that holds a connection without finishing its request is cut off: headers trickled
byte by byte, a body that never ends, a connection that never says anything. Each is answered 408
(or closed) within the server's timeouts, and the server answers the next request. Raw sockets on
loopback; every wait is bounded (SOCKET_S, and a sending loop of at most SENDS writes)."""

from __future__ import annotations

import itertools
import json
import select
import socket
import time

import pytest

from tests.helpers.servers import WAIT_S, start_server

httpx = pytest.importorskip("httpx")
TIMEOUT_S = 0.5  # the test server's header and body timeouts
SOCKET_S = 10  # the longest a test waits for the server: far past its timeouts
SENDS = 200  # a slow client's writes, one every GAP_S: 10 s, far past the timeouts
GAP_S = 0.05
HEADERS = b"POST /v1/completions HTTP/1.1\r\nHost: kvports\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def server(chat_model):
    timeouts = ("--header-timeout", TIMEOUT_S, "--body-timeout", TIMEOUT_S)
    running = start_server("--framework", "numpy", "--weights", chat_model, *timeouts)
    yield running
    running.stop()


def connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=SOCKET_S)


def trickle(connection: socket.socket, pieces) -> bytes | None:
    """Send `pieces`, one every GAP_S, reading what the server sends meanwhile, until it closes the
    connection: all it sent. None if the pieces ran out first (it held the connection open)."""
    received = b""
    for piece in itertools.islice(pieces, SENDS):
        while select.select([connection], [], [], 0)[0]:
            try:
                data = connection.recv(65536)
            except ConnectionResetError:
                return received
            if not data:
                return received
            received += data
        try:
            connection.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):  # it closed: what it sent before is still to read
            return received + read_to_close(connection)
        time.sleep(GAP_S)
    return None


def read_to_close(connection: socket.socket) -> bytes:
    """What the server sends until it closes the connection (socket.timeout if it never does)."""
    received = b""
    while True:
        try:
            data = connection.recv(65536)
        except ConnectionResetError:  # it closed with our unread bytes in its buffer: what came before stands
            return received
        if not data:
            return received
        received += data


def status_and_error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"] if body.startswith(b"{") else {}


def assert_it_still_serves(server) -> None:
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT_S).status_code == 200


def test_headers_trickled_past_the_header_timeout_are_answered_408(server):
    with connect(server) as connection:
        answer = trickle(connection, (bytes([byte]) for byte in HEADERS + b"X-Slow: " + b"a" * SENDS))
    assert answer is not None, "the connection was held open"
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert_it_still_serves(server)


def test_a_connection_that_sends_nothing_is_closed(server):
    with connect(server) as connection:
        assert read_to_close(connection) == b""  # closed, with nothing to answer
    assert_it_still_serves(server)


def test_a_chunked_body_that_never_ends_is_answered_408_at_the_body_timeout(server):
    with connect(server) as connection:
        connection.sendall(HEADERS + b"Transfer-Encoding: chunked\r\n\r\n")
        answer = trickle(connection, itertools.repeat(b"1\r\n \r\n"))
    assert answer is not None, "the connection was held open"
    status, error = status_and_error(answer)
    assert status == 408, answer
    assert error["code"] == "body_timeout" and f"{TIMEOUT_S:g} s" in error["message"], error
    assert_it_still_serves(server)


def test_a_body_still_arriving_after_an_early_answer_is_cut_at_the_body_timeout(server):
    """A route that answers without reading the body (here a 404) does not keep reading it forever."""
    with connect(server) as connection:
        connection.sendall(HEADERS.replace(b"/v1/completions", b"/v1/nothing") + b"Transfer-Encoding: chunked\r\n\r\n")
        answer = trickle(connection, itertools.repeat(b"1\r\n \r\n"))
    assert answer is not None, "the connection was held open"
    assert answer.startswith(b"HTTP/1.1 404 "), answer
    assert_it_still_serves(server)
