"""The OpenAI-compatible HTTP server over one `jd.LLM` (docs/architecture.md "serving/").

    from serving import create_app, ServerThread
    app = create_app(llm, model_name="demo")          # a FastAPI app (serving.app)

Modules: `app` (routes, app assembly, disconnect policy), `submission` (body, prompt, queueing
the choices), `render` (OpenAI responses and chunks), `responses` (JSON/SSE writers, the
engine-to-loop listener bridge), `protocol` (request models, errors,
finish-reason mapping), `chat` (chat templates), `streams` (SSE event logs and resume),
`metrics` (Prometheus), `logs` (JSON logs), `server` (`jaxdecode serve`, `ServerThread`),
`distributed` (multi-host: `serve --distributed`, README.md).
Importing this package is cheap: FastAPI is imported when `create_app` is first used.
"""

__all__ = ["create_app", "ServerThread"]


def __getattr__(name):
    if name == "create_app":
        from serving.app import create_app

        return create_app
    if name == "ServerThread":
        from serving.server import ServerThread

        return ServerThread
    raise AttributeError(f"module 'serving' has no attribute {name!r}")
