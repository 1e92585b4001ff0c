"""OpenAI-compatible HTTP server over the batch-1 engine (``bytebound serve``; app factory :func:`create_app`).

FastAPI is imported only when the app is built, so the rest of the CLI works on machines without it.
"""


def __getattr__(name):
    if name == "create_app":
        from bytebound.server.app import create_app
        return create_app
    raise AttributeError(name)


__all__ = ["create_app"]
