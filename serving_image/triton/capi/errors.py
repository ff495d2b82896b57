"""TRITONSERVER_Error: a NULL pointer is success; anything else carries a code and a message, and whoever received
it deletes it (except the error a response holds, which the response owns)."""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """TRITONSERVER_Error_Code, in tritonserver.h's order."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7


class TritonError(RuntimeError):
    """An error Triton returned: `code` (ErrorCode) and Triton's own message."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"TritonError({self.code.name}, {self.message!r})"


def read_error(lib, error) -> TritonError:
    """A TritonError with the code and message of `error` (not deleted here)."""
    raw = lib.TRITONSERVER_ErrorCode(error)
    try:
        code = ErrorCode(raw)
    except ValueError:
        code = ErrorCode.UNKNOWN
    message = lib.TRITONSERVER_ErrorMessage(error)
    return TritonError(code, message.decode("utf-8", "replace") if message else "")


def check(lib, error) -> None:
    """Raise the TritonError that `error` holds (deleting it), or return when it is NULL."""
    if not error:
        return
    try:
        raise read_error(lib, error)
    finally:
        lib.TRITONSERVER_ErrorDelete(error)
