"""`APIError`: an error answered to the client in OpenAI's shape."""

from __future__ import annotations


class APIError(Exception):
    """An error answered to the client: HTTP `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
