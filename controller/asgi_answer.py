"""An error answered from a pure ASGI layer, before any route runs (controller/body_limit.py,
controller/token_before_body.py): the API's usual JSON shape, and the connection closed, so
a body the caller promised is never waited for."""

from __future__ import annotations

import json

from starlette.types import Send


async def refuse(
    send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]] = ()
) -> None:
    body = json.dumps({"detail": detail, "problems": []}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
