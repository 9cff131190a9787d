"""Ollama's API (/api/chat, /api/generate, ...) over the same engine (issue 43; docs/ollama.md).

`core.py` is the sans-IO core (request bodies -> engine plans, engine events -> Ollama's
objects), `options.py` Ollama's `options` -> the engine's sampling, `routes.py` the FastAPI
routes (on --http-port beside the OpenAI API), `server.py` the optional --ollama-port listener.
"""
