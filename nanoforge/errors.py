"""User-facing errors.

Anything a user can get wrong (a path, a flag, a request field) raises
`NanoforgeError` with one sentence that names the file, tensor, field or limit.
The CLI turns it into one line on stderr and exit code 2; the HTTP server turns
it into a 4xx with an OpenAI-style error body. It subclasses ValueError so that
library users can catch it the ordinary way.
"""

from __future__ import annotations


class NanoforgeError(ValueError):
    """A problem with the user's input, explained in one line.

    `param` names the offending field (for HTTP error bodies); `status` is the
    HTTP status the server should answer with.
    """

    def __init__(self, message: str, *, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status
