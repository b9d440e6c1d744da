"""uvicorn's server for the app, with what a server facing the network needs beyond uvicorn's own.

- **Deadlines on each request** (`DeadlineProtocol`, uvicorn's h11 protocol). Its headers must
  arrive within `header_s` of its connection opening, or of its first bytes after a previous
  request (an idle connection between requests is uvicorn's keep-alive timeout, set to the same):
  a connection that says nothing is closed, one that trickles its headers is answered 408 and
  closed. uvicorn has no timer of its own for either, and h11 bounds only the headers' size
  (16 KiB). Its body must arrive within `body_s` of its headers: the app reads it under that
  deadline and answers 408 (`app.read_body`); a body still arriving after an early answer (a 401,
  a 404: uvicorn reads and drops it, forever if it never ends) is cut here.
- **A shutdown that ends what runs with an answer** (`Server.shutdown`). On SIGINT or SIGTERM it
  stops accepting, running requests may finish for `shutdown_s`, then each one still running
  ends with an error (a stream's last chunk, then `[DONE]`; uvicorn's own would cancel the tasks,
  cut the streams mid-chunk and log a CancelledError traceback each). A second signal, either
  one, ends them at once (uvicorn's own takes only a second SIGINT).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

FINAL_S = 1.0  # how long the ended requests may take to write their last chunk before their connections close
POLL_S = 0.05


@dataclass(frozen=True)
class Timeouts:
    header_s: float  # a request's headers, from its connection or its first bytes
    body_s: float  # its body, from its headers
    shutdown_s: float  # running requests' grace after SIGINT or SIGTERM


class DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers and body (make_server sets them)."""

    header_s = body_s = 0.0

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.header_deadline: asyncio.TimerHandle | None = None
        self.body_deadline: asyncio.TimerHandle | None = None
        self.header_deadline = self.loop.call_later(self.header_s, self.headers_late, self.cycle)

    def connection_lost(self, exc: Exception | None) -> None:
        for deadline in (self.header_deadline, self.body_deadline):
            if deadline is not None:
                deadline.cancel()
        super().connection_lost(exc)

    def between_requests(self) -> bool:
        """No request in progress: the last one (if any) read whole and answered whole."""
        return self.cycle is None or (self.cycle.response_complete and self.conn.their_state is not h11.SEND_BODY)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # cancels uvicorn's keep-alive timer: these bytes begin a request
        if self.between_requests() and self.header_deadline is None and not self.transport.is_closing():
            self.header_deadline = self.loop.call_later(self.header_s, self.headers_late, self.cycle)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers came whole: its body's deadline starts
            if self.header_deadline is not None:
                self.header_deadline.cancel()
                self.header_deadline = None
            if self.body_deadline is not None:
                self.body_deadline.cancel()
            self.body_deadline = self.loop.call_later(self.body_s, self.body_late, self.cycle)

    def headers_late(self, cycle: Any) -> None:
        self.header_deadline = None
        if self.cycle is not cycle or not self.between_requests() or self.transport.is_closing():
            return  # a request came whole since
        if self.conn.trailing_data[0]:  # part of a request came: say why it ends (h11 cannot: no request yet)
            message = f"the request's headers did not arrive within {self.header_s:g} s"
            error = {"message": message, "type": "invalid_request_error", "param": None, "code": "header_timeout"}
            body = json.dumps({"error": error}).encode()
            head = (
                "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                f"content-length: {len(body)}\r\n\r\n"
            )
            self.transport.write(head.encode() + body)
        self.transport.close()

    def body_late(self, cycle: Any) -> None:
        self.body_deadline = None
        # The app reads a body under the same deadline and answers 408 itself; an answered request
        # whose body still comes is cut here.
        answered = self.cycle is cycle and cycle.response_complete
        if answered and self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self.transport.close()


def make_server(app: Any, host: str, port: int, what: str, timeouts: Timeouts, end_requests: Callable[[], int]) -> Any:
    """uvicorn's server for the app: one line on stdout once it listens; SIGINT or SIGTERM end it
    cleanly (its run returns, and the command exits 0, not by the signal). end_requests: ends every
    running request with an error, its stream's last chunk (at the end of the grace period)."""

    class Protocol(DeadlineProtocol):
        header_s, body_s = timeouts.header_s, timeouts.body_s

    class Server(uvicorn.Server):
        url = ""

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                bound, number = self.servers[0].sockets[0].getsockname()[:2]
                self.url = f"http://{f'[{bound}]' if ':' in bound else bound}:{number}"
                print(f"kvports serve: ready on {self.url} ({what})", flush=True)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn's own re-raises the signal once it has stopped, which ends the process by it.
            if threading.current_thread() is not threading.main_thread():  # a test's server: no signals
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.should_exit:  # a second signal: end what runs now
                self.force_exit = True
            self.should_exit = True

        async def shutdown(self, sockets: Any = None) -> None:
            for server in self.servers:
                server.close()  # no new connections
            tasks, connections = self.server_state.tasks, self.server_state.connections
            for connection in list(connections):
                connection.shutdown()  # an idle one closes; a busy one closes after its answer
            await until(lambda: not tasks or self.force_exit, timeouts.shutdown_s)
            end_requests()  # what still runs ends with its last chunk, then its connection closes
            await until(lambda: not tasks, FINAL_S)
            for connection in list(connections):  # a client that does not read: its writes are dropped
                connection.transport.close()
            await until(lambda: not tasks, FINAL_S)
            for task in tasks:
                task.cancel()

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=Protocol,
        ws="none",  # no WebSocket routes: an upgrade request is an ordinary request, its deadlines kept
        log_level="warning",
        access_log=False,
        timeout_keep_alive=timeouts.header_s,  # type: ignore[arg-type]  # a float works: it is call_later's
        lifespan="off",
    )
    return Server(config)


async def until(condition: Callable[[], bool], seconds: float) -> None:
    """Wait until `condition()` or `seconds` have passed, whichever comes first."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(POLL_S)
