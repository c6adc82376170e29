"""Authentication before a body is read, on every route that takes one (docs/security.md,
"HTTP input").

FastAPI runs a route's token dependency only once the body has been received and parsed, so
an unauthenticated caller could make the controller wait for and buffer up to the body limit
on each connection. This pure ASGI layer answers 401 from the headers alone when a request
that may carry a body (POST, PUT, PATCH) names no token its route could take: an API token
of any role, or, for the join, the join token. Which role may call what is still each
route's dependency.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from controller.asgi_answer import refuse
from controller.auth import HOW_TO, JOIN_HOW_TO, Auth

JOIN_PATH = "/v1/agents/join"
WITH_BODY = {"POST", "PUT", "PATCH"}


class TokenBeforeBody:
    def __init__(self, app: ASGIApp, auth: Auth):
        self.app, self.auth = app, auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in WITH_BODY or self.auth.insecure:
            return await self.app(scope, receive, send)
        if (why := self._refusal(scope)) is None:
            return await self.app(scope, receive, send)
        await refuse(send, 401, why, [(b"www-authenticate", b'Bearer realm="meshkeeper"')])

    def _refusal(self, scope: Scope) -> str | None:
        """Why the request may not reach its route, from its token alone (None: it may)."""
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        if self.auth.identify(token) is not None:
            return None  # a known caller: its route judges its role
        if scope["path"] == JOIN_PATH:
            return None if self.auth.join_ok(token) else JOIN_HOW_TO
        return f"{scope['method']} {scope['path']} needs a valid bearer token; {HOW_TO}"
