"""Errors as vLLM's OpenAI server sends them: HTTP status plus a JSON `error` object."""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus
from typing import Any


class ApiError(Exception):
    """An error the client sees as `{"error": {message, type, param, code}}` with HTTP `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        err_type: str = "BadRequestError",
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }


def error_type(status: int) -> str:
    """The `type` vLLM gives an error of HTTP `status`: its phrase in CamelCase + "Error"."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "Error"
    name = "".join(word.capitalize() for word in phrase.replace("-", " ").split())
    return name if name.endswith("Error") else name + "Error"
