"""`tokq serve`: an OpenAI-compatible HTTP server (vLLM's API dialect) over tokq's continuous-batching engine.

protocol.py (request bodies, error JSON), jobs.py (a body -> engine requests, vLLM's limits), chat.py
(messages -> prompt via the chat template), engine_loop.py (the one thread that owns the engine),
openai_format.py (engine outputs -> response JSON), metrics.py (Prometheus), app.py (`build_app`, the
routes), launch.py (load a model, run uvicorn with a graceful SIGTERM), testing.py (an app on a free port
in a thread, for tests).
"""
