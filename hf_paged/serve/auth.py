"""Who may call the server: the API key, checked at start (`check_api_key`) and on every request but
`/health` (`RequireKey`, compared in constant time)."""

from __future__ import annotations

import hmac
import json

from .openai_protocol import APIError


def check_api_key(api_key: str | None) -> None:
    """Refuse a key that would leave the server open or unusable (None means no key: open on purpose).

    Raises:
        ValueError: an empty or blank key, or one with characters a header cannot carry.
    """
    if api_key is None:
        return
    if not isinstance(api_key, str) or not api_key.strip():
        raise ValueError("the API key is empty (--api-key '' or HF_PAGED_API_KEY=''): that would leave every route "
                         "open; give a real key, or unset it to serve without one")
    if api_key != api_key.strip() or not api_key.isprintable() or not api_key.isascii():
        raise ValueError("the API key must be printable ASCII without surrounding spaces (it travels in the "
                         "Authorization header)")


class RequireKey:
    """ASGI middleware: 401 in OpenAI's shape for a missing or wrong `Authorization: Bearer <key>` on
    every path but `/health` (plain ASGI: no task or stream wrapping per request, which
    `@app.middleware` would add to every call, `/health` included)."""

    def __init__(self, app, key: str):
        self.app = app
        self._key = key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self._key):
                from starlette.responses import Response  # the `serve` extra, present once a server runs

                error = APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")
                response = Response(json.dumps(error.body()), status_code=401, media_type="application/json")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
