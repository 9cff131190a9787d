"""What `--model` accepts, checked before anything loads (no torch here).

A model is a `.gguf` file, a Hugging Face model directory (config.json, *.safetensors and the
tokenizer files), or the built-in default's name. tokenwire never downloads from a model hub,
so a hub id such as `HuggingFaceTB/SmolLM2-135M-Instruct` is refused with what to do instead.
"""

from __future__ import annotations

from pathlib import Path

BUILTIN_NAME = "SmolLM2-135M-Instruct"  # model/loader.py's DEFAULT_MODEL_NAME
ACCEPTED = (
    f"--model accepts a .gguf file, a Hugging Face model directory (config.json, *.safetensors, "
    f"tokenizer files) or {BUILTIN_NAME} (the built-in model, also the default)"
)


def check_model_spec(spec: str | None) -> str | None:
    """The model to load (None: the built-in one), or ValueError/FileNotFoundError saying what
    `--model` accepts."""
    if spec is None or spec == BUILTIN_NAME:
        return None
    path = Path(spec).expanduser()
    if not path.exists():
        looks_like_hub_id = spec.count("/") == 1 and not spec.startswith((".", "/", "~"))
        hint = (
            " (a model hub id? tokenwire never downloads models: download it, then give its directory)"
            if looks_like_hub_id
            else ""
        )
        raise FileNotFoundError(f"model not found: {spec}{hint}. {ACCEPTED}")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"{spec} is a directory without config.json. {ACCEPTED}")
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise ValueError(f"unsupported model file {spec}. {ACCEPTED}")
    return str(path)
