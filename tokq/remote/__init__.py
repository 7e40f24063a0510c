"""Talking to an OpenAI-compatible endpoint (tokq serve, vLLM, llama.cpp's server, ...).

http.py is the one HTTP client (retries, timeouts, one-line errors, SSE streaming) that everything which calls
an endpoint uses; bench_serve.py is the client-side load generator behind `tokq bench --base-url`.
"""
