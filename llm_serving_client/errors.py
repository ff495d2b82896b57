"""The errors of a call, each naming the model, the version (when one is pinned or known) and the field at fault.

Callers catch `CallError` (or one subclass) and read `.model`, `.version`, `.field`; the message says the same in
words, so a log line alone is enough to find the bad input (docs/clients.md, "Calls").
"""

from __future__ import annotations


class CallError(Exception):
    """A call that did not produce an answer."""

    retryable = False

    def __init__(self, message: str, *, model: str, version: str | None = None, field: str | None = None):
        self.model, self.version, self.field, self.detail = model, version, field, message
        where = f"model {model!r}" + (f" version {version!r}" if version else "")
        super().__init__(f"{where}" + (f" field {field!r}" if field else "") + f": {message}")


class InvalidRequest(CallError):
    """The request is wrong (a missing or unknown tensor, a wrong datatype or shape, a field the server refused):
    never retried, since the same request fails the same way."""


class Unavailable(CallError):
    """The server could not be reached or could not serve (gRPC UNAVAILABLE, a refused connection, HTTP 502-504).
    Retried by the client only when the call is safe to repeat and no output reached the caller."""

    retryable = True


class Overloaded(CallError):
    """HTTP 429: the server's admission refused the request; `retry_after_s` is the server's advice, the caller's to
    honour (the client does not retry: the load would only grow)."""

    def __init__(self, message: str, *, model: str, version: str | None = None, retry_after_s: float | None = None):
        super().__init__(message, model=model, version=version)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(CallError):
    """The call's deadline passed before an answer arrived (or before an attempt could start)."""


class ServerError(CallError):
    """Any other failure the server reported (HTTP 5xx but 502-504, gRPC INTERNAL...), with its message."""


class ExperimentError(CallError):
    """An experiment named by the caller does not exist, or conflicts with the call (another model, a field the arm
    sets too)."""
