"""Named errors. Every failure the user can cause has its own class and a message naming the culprit."""


class ByteboundError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(ByteboundError, ValueError):
    """config.json is missing a field, has a wrong value, or two fields contradict each other."""


class CheckpointError(ByteboundError):
    """A checkpoint tensor is missing, unexpected, mis-shaped, of the wrong dtype, non-finite, or a shard
    is truncated/unreadable. The message names the tensor(s) and the file."""


class QuantFormatError(ByteboundError, ValueError):
    """A quantised tensor or its scale has the wrong layout, dtype or value range."""


class BackendError(ByteboundError):
    """A requested kernel backend is unavailable or does not support the shape, and fallback was not allowed."""


class ResourceError(ByteboundError):
    """The machine lacks a resource the run needs (e.g. memory for the weights); the message gives the amounts."""


class VerificationError(ByteboundError):
    """A start-up canary failed or a requested lever did not resolve (``--strict``)."""


class RequestError(ByteboundError, ValueError):
    """A generation request has invalid parameters (maps to HTTP 400). ``param``: the request field at fault, when
    one is (the server reports it as the error's ``param``)."""

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param
