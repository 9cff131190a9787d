"""The OpenAI-compatible HTTP API (chat, completions, models) plus sessions, fork and rewind.

core.py is the sans-IO core (requests -> engine plans, events -> OpenAI objects), chat.py the
chat template and tool calls, sampling.py the engine options, output.py one choice's output,
runner.py the engine side of a request, transport.py and sessions.py the FastAPI routes.
"""
