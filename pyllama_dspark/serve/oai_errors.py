"""The error every request check raises (:class:`RequestError`: an HTTP status with an
OpenAI-style body) and the type names its messages use."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["RequestError"]


class RequestError(Exception):
    """A request the server refuses: HTTP ``code`` with an OpenAI-style error body."""

    def __init__(self, message: str, type: str = "invalid_request_error", code: int = 400,
                 param: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.type = type
        self.code = code
        self.param = param


def _typename(v: Any) -> str:
    return "null" if v is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                     list: "array", dict: "object"}.get(type(v), type(v).__name__)


def _is(v: Any, types) -> bool:
    return isinstance(v, types) and not isinstance(v, bool)

