"""OpenAI's Responses API (`/v1/responses`) on the OpenAI-compatible HTTP port (docs/responses.md)."""
