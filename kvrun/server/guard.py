"""Connection limits of kvrun serve, over uvicorn's HTTP protocol class (kvrun serve takes h11's;
httptools' keeps its request in flight in `cycle` too).

uvicorn times out neither a connection that has not sent a request yet (its keep-alive timer
starts after a first response) nor headers that arrive a byte at a time, and its
`limit_concurrency` counts idle connections as well: with it, clients that connect and send
nothing would get everyone else a 503. Here instead:

- a connection has `read_timeout` seconds from opening, or from its last response, to deliver a
  request's headers; then it is closed, with a 408 if part of a request came (a request's body
  has as long again once its handler reads it: kvrun.server.app);
- beyond `max_connections`, a new connection closes the one that has waited longest for a
  request (idle: a request in flight or a stream is never closed); when none is idle, its
  request is answered 503 with Retry-After. So clients that send nothing can neither exhaust
  the process's file descriptors nor keep /health and other requests out.
"""

from __future__ import annotations

import json

from .schema import error_body


def _response(status: str, message: str, code: str) -> bytes:
    """A whole HTTP response with an OpenAI error object, written past the protocol's parser
    (which has no request to answer yet)."""
    body = json.dumps(error_body(message, "invalid_request_error", code)).encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class Guarded:
    """A mixin over uvicorn's HTTP protocol class: guarded(base, ...) makes the class."""

    read_timeout = 30.0
    max_connections = 512

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._timer = None
        self._await_request()
        if len(self.connections) <= self.max_connections:
            return
        # those closed already but not yet gone (connection_lost comes in a later callback)
        # do not count
        others = [c for c in self.connections if c is not self and not c.transport.is_closing()]
        if len(others) < self.max_connections:
            return
        idle = [c for c in others if isinstance(c, Guarded) and c._idle()]
        if idle:
            min(idle, key=lambda c: c._since).transport.close()
        else:  # every other one has a request in flight: this one's request gets 503
            self.app = _too_many

    def data_received(self, data: bytes) -> None:
        if self._idle():
            self._began = True
        super().data_received(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._await_request()

    def connection_lost(self, exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)

    def _idle(self) -> bool:
        """Waiting for a request (none yet, or the last one answered), and not closing."""
        cycle = self.cycle
        waiting = cycle is None or cycle.response_complete
        return waiting and not self.transport.is_closing()

    def _await_request(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._since, self._began = self.loop.time(), False
        self._timer = self.loop.call_later(self.read_timeout, self._expire)

    def _expire(self) -> None:
        self._timer = None
        if not self._idle():  # a request in flight: its handler bounds the body's time
            return
        if self._began:
            msg = f"the request's headers did not arrive within {self.read_timeout:g} s"
            self.transport.write(_response("408 Request Timeout", msg, "request_timeout"))
        self.transport.close()


def guarded(base: type, read_timeout: float, max_connections: int) -> type:
    """uvicorn's protocol class `base` with the limits above (uvicorn.Config(http=...))."""
    limits = {"read_timeout": read_timeout, "max_connections": max_connections}
    return type(f"Guarded{base.__name__}", (Guarded, base), limits)


_TOO_MANY = json.dumps(
    error_body(
        "too many connections (--max-connections); retry shortly",
        "server_error",
        "too_many_connections",
    )
).encode()


async def _too_many(scope, receive, send) -> None:
    """The ASGI app a connection over the limit gets: 503, Retry-After, and close."""
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(_TOO_MANY)).encode()),
        (b"retry-after", b"1"),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": _TOO_MANY})
