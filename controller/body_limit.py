"""A limit on every request body, whatever the route (docs/security.md, "HTTP input").

Pure ASGI, outside every route: a declared `Content-Length` over the limit is answered 413
before a byte of the body is read (and before any route reads a token from it or validates it),
and a body streamed without one is cut off as it passes the limit. Routes that parse a body
never see more than the limit, so no caller, authenticated or not, makes the controller buffer
50 MB.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controller.asgi_answer import refuse


class _TooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send, f"the body is {int(declared)} bytes; the limit is")
        seen, over, started = 0, False, False

        async def counted() -> Message:
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    over = True
                    raise _TooLarge
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            if over:  # the route answered a body it could not read (FastAPI: a 400): 413
                if not started:
                    started = True
                    await self._refuse(send, "the body is over the limit of")
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except _TooLarge:
            if not started:
                await self._refuse(send, "the body is over the limit of")

    async def _refuse(self, send: Send, what: str) -> None:
        await refuse(send, 413, f"{what} {self.limit} bytes")
