"""Ollama's model listing and description routes as plain values: /api/tags, /api/show,
/api/ps, /api/version. One model is served; it is listed as `NAME:latest`, and requests may name
it with or without the tag."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenwire.protocols.ollama.core import served_name
from tokenwire.protocols.ollama.errors import bad_request, model_not_found
from tokenwire.protocols.openai import chat
from tokenwire.protocols.openai.core import ModelLimits

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI

# the Ollama release whose API this imitates (clients check /api/version against minimums)
OLLAMA_VERSION = "0.12.0"
NEVER = "9999-12-31T23:59:59Z"  # a loaded model here stays loaded (keep_alive is not applied)


@dataclass(frozen=True)
class ModelInfo:
    """What the listing routes say about the loaded model."""

    name: str  # NAME:latest
    family: str  # "llama", "qwen2", ...
    format: str  # "gguf" | "safetensors"
    size: int  # bytes of the model's file (0 when unknown)
    parameters: int
    context_length: int
    embedding_length: int
    block_count: int
    template: str  # the chat template
    tools: bool  # the chat template shows tools to the model
    gpu: bool
    modified_at: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.name}:{self.size}".encode()).hexdigest()

    def details(self) -> dict[str, Any]:
        return {
            "parent_model": "",
            "format": self.format,
            "family": self.family,
            "families": [self.family],
            "parameter_size": _size(self.parameters),
            "quantization_level": "",
        }


def _size(parameters: int) -> str:
    if parameters >= 10**9:
        return f"{parameters / 10**9:.1f}B"
    return f"{parameters / 10**6:.0f}M" if parameters else ""


def model_info(engine: EngineAPI, limits: ModelLimits, modified_at: str) -> ModelInfo:
    config = engine.config
    source = getattr(engine, "source", None)
    gguf = getattr(source, "gguf", None)
    size = 0
    try:
        if gguf is not None:
            size = gguf.stat().st_size
        elif source is not None:
            size = sum(p.stat().st_size for p in source.model_dir.glob("*.safetensors"))
    except OSError:
        size = 0
    hidden, layers = config.hidden_size, config.num_layers
    kv = config.num_kv_heads * config.head_dim
    per_layer = (
        hidden * (hidden + 2 * kv + config.num_heads * config.head_dim)
        + 3 * hidden * config.intermediate_size
    )
    embeddings = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2)
    template = limits.tokenizer.hf.chat_template
    return ModelInfo(
        name=served_name(limits),
        family=config.architecture.removesuffix("ForCausalLM").lower() or "unknown",
        format="gguf" if gguf is not None else "safetensors",
        size=size,
        parameters=embeddings + layers * per_layer,
        context_length=limits.max_model_len,
        embedding_length=hidden,
        block_count=layers,
        template=template if isinstance(template, str) else "",
        tools=chat.supports_tools(limits.tokenizer),
        gpu=getattr(engine, "device_type", "cpu") == "cuda",
        modified_at=modified_at,
    )


def version() -> dict[str, Any]:
    return {"version": OLLAMA_VERSION}


def tags(info: ModelInfo) -> dict[str, Any]:
    return {
        "models": [
            {
                "name": info.name,
                "model": info.name,
                "modified_at": info.modified_at,
                "size": info.size,
                "digest": info.digest,
                "details": info.details(),
            }
        ]
    }


def ps(info: ModelInfo) -> dict[str, Any]:
    return {
        "models": [
            {
                "name": info.name,
                "model": info.name,
                "size": info.size,
                "digest": info.digest,
                "details": info.details(),
                "expires_at": NEVER,
                "size_vram": info.size if info.gpu else 0,
                "context_length": info.context_length,
            }
        ]
    }


def show(body: Any, info: ModelInfo, limits: ModelLimits) -> dict[str, Any]:
    """`{"model": NAME}` (older clients: `"name"`) -> the model's description."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model") or body.get("name")
    if not model or not isinstance(model, str):
        raise bad_request("model is required")
    if model not in (limits.name, info.name):
        raise model_not_found(model)
    family = info.family
    return {
        "modelfile": f"# served by tokenwire\nFROM {limits.name}\n",
        "parameters": "",
        "template": info.template,
        "details": info.details(),
        "model_info": {
            "general.architecture": family,
            "general.parameter_count": info.parameters,
            f"{family}.context_length": info.context_length,
            f"{family}.embedding_length": info.embedding_length,
            f"{family}.block_count": info.block_count,
        },
        "capabilities": ["completion", "tools"] if info.tools else ["completion"],
        "modified_at": info.modified_at,
    }
