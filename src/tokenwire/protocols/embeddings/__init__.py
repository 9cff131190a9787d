"""Embeddings from the loaded model (issue 43): OpenAI's POST /v1/embeddings.

core.py: `embed(engine, inputs, ...)`, the function every API that serves embeddings calls
(Ollama's /api/embed too); pooling.py: the pooling a model declares and the math; wire.py: the
OpenAI request and response (sans-IO); routes.py: the FastAPI route.
"""
