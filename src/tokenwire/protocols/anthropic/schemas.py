"""The request bodies of Anthropic's Messages API, as pydantic models.

The routes validate these themselves (not through FastAPI's body parameters), so a refused body
is answered in Anthropic's error shape. Numbers use the OpenAI side's Int/Number types: the
engine's rules (engine/request.py) refuse true/false, NaN and infinities, naming the field.
Top-level fields are strict (a typo is not silently ignored); content blocks ignore fields that
change nothing here (cache_control, citations), and core.py refuses block types it cannot serve.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tokenwire.protocols.openai.schemas import MAX_STOP_CHARS, Int, Number

# Each stop string is matched on every generated token (engine/stop.py), so their number is
# bounded; Anthropic documents no limit, and clients send one or two.
MAX_STOP_SEQUENCES = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Block(BaseModel):
    """One content block: text, image, tool_use, tool_result (or a type core.py refuses)."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None
    source: dict[str, Any] | None = None  # image: {type: base64, media_type, data} | {type: url, url}
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None
    is_error: bool | None = None


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDef(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, ...) are not served
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None  # one call per answer here anyway


class Thinking(_Strict):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: Int | None = None


class OutputFormat(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    effort: str | None = None  # a reasoning budget: nothing to budget here
    format: OutputFormat | None = None  # structured output: the answer follows this JSON schema


class _Conversation(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None  # the prefix cache works on every request anyway


class CountTokensRequest(_Conversation):
    """POST /v1/messages/count_tokens: the conversation without the sampling fields."""


class MessagesRequest(_Conversation):
    max_tokens: Int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: Number | None = Field(default=None, ge=0, le=1)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    top_k: Int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None  # {user_id}: Anthropic's abuse tracking, nothing here
    stream: bool = False
    service_tier: str | None = None  # Anthropic's capacity tiers: one tier here

    @field_validator("stop_sequences")
    @classmethod
    def _check_stops(cls, stops: list[str] | None) -> list[str] | None:
        if stops is None:
            return None
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences are at most {MAX_STOP_CHARS} characters")
        return stops
