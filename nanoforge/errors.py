"""The two kinds of failure, kept apart.

Bad input is the user's to fix: a path, a flag, a file, a request field, a
prompt too long for the context, or a service state the client must wait out
(busy, shutting down). It raises `NanoforgeError` with one sentence that names
the file, tensor, field or limit. The CLI prints it as one line on stderr and
exits with code 2; the HTTP server answers it with its 4xx (or 503) status and
an OpenAI-style error body. It subclasses ValueError so that library users can
catch it the ordinary way.

Everything else is a bug (ours, or a broken device): a kernel handed tensors
of the wrong shape by our own model code, a failed compile, an engine step that
crashes. Those raise ordinary exceptions (ValueError, RuntimeError, ...) and
keep their traceback: the CLI lets it print and exits with code 1; the server
logs it with its traceback and answers HTTP 500. Never raise NanoforgeError
for a condition that only a bug can cause.
"""

from __future__ import annotations


class NanoforgeError(ValueError):
    """A problem with the user's input, explained in one line.

    `param` names the offending field (for HTTP error bodies); `status` is the
    HTTP status the server should answer with; `retry_after`, for 429 and 503,
    the seconds a client should wait before trying again.
    """

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, retry_after: int = 1):
        super().__init__(message)
        self.param = param
        self.status = status
        self.retry_after = retry_after


class InternalError(RuntimeError):
    """A bug or device failure that was already logged with its traceback where it happened (the engine
    thread) and now reaches the requests it broke: the server answers each with HTTP 500."""
