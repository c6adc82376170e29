"""A deadline on every request's arrival (docs/security.md, "HTTP input").

uvicorn closes a keep-alive connection left idle after a response, but it waits for ever on a
client that opens a connection and sends its request a byte at a time, or not at all: a few
hundred such sockets (slowloris) hold the controller's file descriptors and memory while
costing the sender nothing. Here the whole request, headers and body, must arrive within
`timeout_s` of the connection opening or of the previous response; a client still sending
then has its connection closed. The handler's own time does not count.
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("meshkeeper.api")
# h11's states of a client whose request has not fully arrived: its headers, then its body
ARRIVING = (h11.IDLE, h11.SEND_BODY)


def request_deadline(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the deadline above (uvicorn.run(..., http=...))."""

    class RequestDeadline(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._deadline: asyncio.TimerHandle | None = None
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state not in ARRIVING:
                self._disarm()  # the request is in: what follows is the handler's time

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # the next request on this connection gets its own deadline (one pipelined behind
            # this response may already be in, and be running)
            if not self.transport.is_closing() and self.conn.their_state in ARRIVING:
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            host = f"{self.client[0]}:{self.client[1]}" if self.client else "?"
            log.warning(
                "closed a connection from %s: no complete request within %.0f s", host, timeout_s
            )
            self.transport.close()

    return RequestDeadline
