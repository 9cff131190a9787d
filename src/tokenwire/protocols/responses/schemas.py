"""The request body of `POST /v1/responses`, as a pydantic model (FastAPI validates it and
serves it at /openapi.json).

Numbers go through the same validators as chat completions (engine/request.py's rules: no
NaN/Infinity, no true/false for an integer). `input` items are checked item by item in
core.py, which names the offending item (`input.2.call_id`). Unknown fields are refused, except
the OpenAI fields in IGNORED that only concern OpenAI's hosted service.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenwire.protocols.openai.schemas import Int, Number

IGNORED = ("user", "service_tier", "prompt_cache_key", "safety_identifier", "truncation", "reasoning")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    """`text.format`: plain text, any JSON object, or JSON following `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.json_schema is None or not self.name):
            raise ValueError("type json_schema needs a name and a schema")
        return self


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, changes nothing


class ResponseCreate(_Strict):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: Int | None = Field(default=None, ge=1)
    temperature: Number | None = Field(default=None, ge=0, le=2)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = Field(default=None, max_length=0, description="nothing extra to include")
    # OpenAI fields that change nothing here
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    # tokenwire extensions (extra_body), as on chat completions
    seed: Int | None = None
    top_k: Int | None = Field(default=None, ge=0)
    priority: Int | None = Field(default=None, ge=0, le=10)
