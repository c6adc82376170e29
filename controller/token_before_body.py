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
from controller.auth import JOIN_HOW_TO, Auth, Denied

API = "/v1/"  # every route there needs a token; the public ones (/healthz ...) take no body
JOIN_PATH = "/v1/agents/join"
WITH_BODY = {"POST", "PUT", "PATCH"}


class TokenBeforeBody:
    def __init__(self, app: ASGIApp, auth: Auth):
        self.app, self.auth = app, auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] not in WITH_BODY
            or not scope["path"].startswith(API)
            or self.auth.insecure
            or (no := self._refusal(scope)) is None
        ):
            return await self.app(scope, receive, send)
        await refuse(send, no.status, no.detail, [(b"www-authenticate", no.challenge.encode())])

    def _refusal(self, scope: Scope) -> Denied | None:
        """Why the request may not reach its route, from its token alone (None: it may): the
        route's own 401, so a caller sees the same answer before and after the body."""
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        token = token.strip() if scheme.lower() == "bearer" and token.strip() else None
        if scope["path"] == JOIN_PATH and self.auth.join_ok(token):
            return None
        try:
            self.auth.authenticate(f"{scope['method']} {scope['path']}", token)
        except Denied as e:
            if scope["path"] == JOIN_PATH:
                return Denied(401, JOIN_HOW_TO, e.challenge)
            return e
        return None  # a known caller: its route judges its role
