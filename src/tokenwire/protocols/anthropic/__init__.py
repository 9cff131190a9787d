"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) on --http-port.

schemas.py holds the request bodies, core.py the sans-IO core (a request -> the OpenAI side's
chat request and engine Plan; a finished or streaming output -> Anthropic's message objects and
named SSE events), errors.py Anthropic's error shape, routes.py the FastAPI routes. The engine
side (admission, cancellation, metrics) is the OpenAI API's runner, shared as it is.
"""
