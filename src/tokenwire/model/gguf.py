"""Read a llama.cpp GGUF file's model description into a Hugging Face model directory.

The directory holds what transformers itself makes of the GGUF's metadata: `config.json`,
`generation_config.json` and a tokenizer built by transformers' GGUF tokenizer conversion, with
two fixes it lacks (pre-tokenizer splits for the StarCoder/SmolLM family, and BOS/EOS insertion
from `tokenizer.ggml.add_*_token`). No weights: those are read from the GGUF itself at each load
(gguf_weights.py), in the file's own blocks.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from tokenwire.model.cache_dir import default_cache_dir
from tokenwire.model.config import ModelConfig, UnsupportedArchitectureError
from tokenwire.model.families import GGUF_FAMILIES, read_config
from tokenwire.model.families.base import Family, GgufMeta, GgufNames
from tokenwire.model.gguf_header import GgufHeader, read_header

# Bump when the output of convert_gguf changes. (Cache keys also hash this file's source and the
# versions of the libraries the conversion uses; see converter_fingerprint.)
# 4: every family's metadata; 3: no weights (read from the GGUF at load); 2 wrote fp32 + packed copies
CONVERTER_VERSION = 4

# llama.cpp pre-tokenizer types that split every digit off before the GPT-2 regex (llama-vocab.cpp);
# transformers 5.23 falls back to the plain GPT-2 regex for these, which merges e.g. "a  1" differently.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}


def converter_fingerprint() -> str:
    """Changes whenever the conversion may give a different result: this module's source, or the
    gguf / transformers / tokenizers versions it relies on."""
    h = hashlib.sha256(f"v{CONVERTER_VERSION}".encode())
    h.update(Path(__file__).read_bytes())
    for dist in ("gguf", "transformers", "tokenizers"):
        try:
            h.update(f"{dist}={metadata.version(dist)}".encode())
        except metadata.PackageNotFoundError:
            pass
    return h.hexdigest()[:16]


def _f32(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def gguf_meta(header: GgufHeader) -> GgufMeta:
    """The file's metadata and tensor shapes (no weight data is read)."""
    shapes = {name: t.shape for name, t in header.tensors.items()}
    arch = str(header.fields.get("general.architecture"))
    return GgufMeta(arch, header.fields, shapes, header.values, header.path)


def gguf_to_hf_config(reader: GgufHeader, path: Path | str = "<gguf>") -> dict[str, Any]:
    """config.json contents for a GGUF file (metadata only; no weight data is read)."""
    info = gguf_meta(reader)
    meta = info.fields
    family = gguf_family(info, path)
    assert family.gguf is not None
    model_type = family.gguf.model_type
    hf_arch = next(a for a, t in family.architectures.items() if t == model_type)
    tensors = set(info.shapes)
    get, need = info.get, info.need

    if "tokenizer.ggml.tokens" not in reader.lengths:
        raise ValueError(f"GGUF file {path} has no tokenizer (tokenizer.ggml.tokens)")

    hidden, heads = need("embedding_length"), need("attention.head_count")
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts; only uniform ones are representable
        if len(set(kv_heads)) != 1:
            raise UnsupportedArchitectureError(f"per-layer KV head counts {kv_heads} in {path}")
        kv_heads = kv_heads[0]
    head_dim = int(get("attention.key_length", hidden // heads))
    rot_dim = int(get("rope.dimension_count", head_dim))
    if rot_dim != head_dim:
        raise UnsupportedArchitectureError(f"partial rotary embedding ({rot_dim}/{head_dim} dims) in {path}")
    vocab = get("vocab_size") or reader.lengths["tokenizer.ggml.tokens"]
    theta = _f32(get("rope.freq_base", 10000.0))
    # eot/eom (end of turn / message, Llama 3) also end generation, as in HF generation configs.
    eos = [meta[key] for k in ("eos", "eot", "eom") if (key := f"tokenizer.ggml.{k}_token_id") in meta]
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(reader, get, theta, head_dim, path),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": model_type == "qwen2" or "blk.0.attn_q.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(int(e) for e in eos)) or None,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if isinstance(config["eos_token_id"], list) and len(config["eos_token_id"]) == 1:
        config["eos_token_id"] = config["eos_token_id"][0]
    config.update(family.gguf.config(info))
    return config


def _rope_scaling(reader: GgufHeader, get: Any, theta: float, dim: int, path: Path | str) -> dict | None:
    kind = get("rope.scaling.type", "none")
    if kind == "longrope":  # Phi-3's factors are tensors its family reads
        return None
    freqs = reader.tensors.get("rope_freqs.weight")
    if kind not in ("none", "") and freqs is None:
        scaling: dict[str, Any] = {"rope_type": kind, "factor": _f32(get("rope.scaling.factor", 1.0))}
        if get("rope.scaling.original_context_length") is not None:
            scaling["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
        return scaling  # ModelConfig rejects anything but llama3, naming the kind
    if freqs is None:
        return None
    factors = reader.values("rope_freqs.weight").astype(np.float64).reshape(-1)
    if np.allclose(factors, 1.0):
        return None
    old_context = int(get("rope.scaling.original_context_length", 8192))
    return _infer_llama3_scaling(factors, theta, dim, old_context, path)


def llama3_rope_factors(theta: float, dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """llama.cpp's `rope_freqs` tensor for Llama 3 scaling: the divisor of each inverse frequency."""
    factor, old = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    smooth = (old / wavelen - low) / (high - low)
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, medium))


def _infer_llama3_scaling(factors: np.ndarray, theta: float, dim: int, old: int, path: Path | str) -> dict:
    """Recover HF's llama3 rope_scaling from llama.cpp's precomputed `rope_freqs` tensor.

    Between the two wavelength cut-offs, 1/factor_i is linear in 1/wavelength_i; a line fit through
    those points gives low/high_freq_factor for the given original context length."""
    factor = float(factors.max())
    x = old / (2 * math.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))  # old / wavelength
    mid = (factors > 1 + 1e-4) & (factors < factor * (1 - 1e-4))
    if mid.sum() >= 2 and len(factors) == len(x):
        smooth = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(x[mid], smooth, 1)  # smooth = (x - low) / (high - low)
        low, high = -intercept / slope, (1 - intercept) / slope
        scaling = {
            "rope_type": "llama3",
            "factor": round(factor, 4),
            "low_freq_factor": round(float(low), 4),
            "high_freq_factor": round(float(high), 4),
            "original_max_position_embeddings": old,
        }
        if np.allclose(llama3_rope_factors(theta, dim, scaling), factors, rtol=1e-3):
            return scaling
    raise UnsupportedArchitectureError(f"rope_freqs tensor in {path} does not match llama3 rope scaling")


def gguf_family(meta: GgufMeta, path: Path | str = "<gguf>") -> Family:
    """The family a GGUF's `general.architecture` names (Mixtral's files say "llama" and count
    experts: the family with experts of that architecture)."""
    experts = int(meta.get("expert_count") or 0) > 0
    candidates = GGUF_FAMILIES.get(meta.arch, [])
    if not candidates:
        supported = ", ".join(GGUF_FAMILIES)
        raise UnsupportedArchitectureError(
            f"unsupported GGUF architecture {meta.arch!r} in {path}: tokenwire converts {supported}"
        )
    for family in candidates:
        assert family.gguf is not None
        if family.gguf.experts == experts:
            return family
    kind = "with" if experts else "without"
    raise UnsupportedArchitectureError(
        f"unsupported GGUF architecture {meta.arch!r} {kind} experts in {path}: tokenwire has no such family"
    )


def hf_tensor_name(gguf_name: str, names: GgufNames) -> str | None:
    """HF name for a GGUF tensor name ("{e}" in it for stacked experts); None for tensors HF has
    no parameter for (rope_freqs, Phi-3's rope factors: config)."""
    stem, _, kind = gguf_name.rpartition(".")
    parts = stem.split(".")
    if stem in ("rope_freqs", "rope_factors_long", "rope_factors_short"):
        return None
    if stem in names.globals:
        return f"{names.globals[stem]}.{kind}"
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names.layer:
        return f"model.layers.{parts[1]}.{names.layer[parts[2]]}.{kind}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file")


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its converter's `permute`): per head, rows go from the
    interleaved (pairs) order back to HF's rotate-half order."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_gguf(
    gguf_path: Path, out_dir: Path, *, progress: bool = True, tokenizer_from: Path | None = None
) -> ModelConfig:
    """Write config.json, generation_config.json and tokenizer files for `gguf_path` into
    `out_dir` (no tensor data is read). Returns the parsed ModelConfig. `tokenizer_from`: a
    converted tokenizer of the same fields (the tokenizer cache) copied instead of built."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = read_header(gguf_path)
    config = gguf_to_hf_config(reader, gguf_path)
    try:
        model_config = read_config(config)
    except UnsupportedArchitectureError as e:
        raise UnsupportedArchitectureError(f"{e} (in {gguf_path})") from e
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is not None:
        turn_ends = _copy_tokenizer(tokenizer_from, out_dir)
    else:
        turn_ends = _write_tokenizer(reader, gguf_path, out_dir)
        (out_dir / _TURN_ENDS).write_text(json.dumps(turn_ends) + "\n")  # for the tokenizer cache
    if turn_ends:
        eos = config["eos_token_id"]
        listed = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        merged = list(dict.fromkeys([*listed, *turn_ends]))
        config["eos_token_id"] = merged[0] if len(merged) == 1 else merged
        model_config = read_config(config)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config[k] is not None}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return model_config


# A converted tokenizer, kept by the digest of everything it is built from (the architecture,
# every tokenizer.* field, the converter's version): each quantisation of one model, or each of
# the tests' tiny models over the shipped vocabulary, converts it once. Building it imports
# transformers in a child and takes 4-8 s a file here; a cached one is copied in milliseconds.
_TURN_ENDS = ".turn_ends.json"
_NOT_TOKENIZER = ("config.json", "generation_config.json", _TURN_ENDS)


def tokenizer_key(reader: GgufHeader) -> str:
    fields = {k: v for k, v in reader.fields.items() if k.startswith("tokenizer.")}
    what = {
        "architecture": reader.fields.get("general.architecture"),
        "fields": fields,
        "arrays": reader.digests,
        "converter": converter_fingerprint(),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:32]


TOKENIZER_CACHE_ENV = "TOKENWIRE_TOKENIZER_CACHE"


def tokenizer_cache(key: str, cache_dir: Path | None = None) -> Path:
    """Where a converted tokenizer is kept: `.tokenizers/` of the conversions' cache directory
    (--cache-dir; a dot name, so the loader's clean-up of superseded conversions passes it by),
    or $TOKENWIRE_TOKENIZER_CACHE for every cache directory at once (the test suite's dozens of
    throw-away cache directories share their tokenizers through it)."""
    shared = os.environ.get(TOKENIZER_CACHE_ENV)
    if shared:
        return Path(shared) / key
    return (cache_dir if cache_dir is not None else default_cache_dir()) / ".tokenizers" / key


def _copy_tokenizer(cached: Path, out_dir: Path) -> list[int]:
    for file in cached.iterdir():
        if file.name != _TURN_ENDS:
            shutil.copyfile(file, out_dir / file.name)
    return [int(t) for t in json.loads((cached / _TURN_ENDS).read_text())]


def _keep_tokenizer(out_dir: Path, cached: Path) -> None:
    """The tokenizer files just converted into out_dir, copied to the cache (atomically: a
    complete entry or none); the turn-end list moves there."""
    tmp: Path | None = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cached.parent))
        for file in out_dir.iterdir():
            if file.is_file() and file.name not in _NOT_TOKENIZER[:2]:
                shutil.copyfile(file, tmp / file.name)
        os.rename(tmp, cached)
    except OSError:  # a racing writer won, or no room: the cache is only a saving
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    (out_dir / _TURN_ENDS).unlink(missing_ok=True)


def convert_gguf_apart(gguf_path: Path, out_dir: Path, cache_dir: Path | None = None) -> None:
    """convert_gguf in a child process, so what the tokenizer's conversion imports and reads
    (transformers' GGUF reader and its registry of every model) never stays in the server: the
    shipped model's first start peaked 58 MiB higher with it in-process. Its errors come back
    as the type and message they were raised with; its progress and logs go to our stderr. A
    tokenizer converted before (the tokenizer cache) is copied here instead, with no child."""
    cached = tokenizer_cache(tokenizer_key(read_header(gguf_path)), cache_dir)
    if (cached / _TURN_ENDS).is_file():
        convert_gguf(gguf_path, out_dir, tokenizer_from=cached)
        return
    out = subprocess.run(
        [sys.executable, "-m", __name__, str(gguf_path), str(out_dir)], stdout=subprocess.PIPE, text=True
    )
    if out.returncode == 0:
        _keep_tokenizer(out_dir, cached)
        return
    try:
        error = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RuntimeError(f"converting {gguf_path} failed (exit status {out.returncode})") from None
    kind = {e.__name__: e for e in (UnsupportedArchitectureError, ValueError, FileNotFoundError)}
    raise kind.get(error["type"], RuntimeError)(error["message"])


# Tokens llama.cpp ends generation at by their text (llama-vocab.cpp), as converters often
# record only the end-of-sequence token: Gemma's files say <eos> while its turns end with
# <end_of_turn>. We take those the file's chat template writes, so a chat stops where the
# template ends the model's turn (and a token the template never writes changes nothing).
_TURN_END_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
)  # fmt: skip


def _write_tokenizer(reader: GgufHeader, gguf_path: Path, out_dir: Path) -> list[int]:
    """Writes the tokenizer files; returns the turn-ending tokens the chat template writes."""
    # local: transformers takes seconds to import; only a GGUF's first conversion writes a tokenizer
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import pre_tokenizers, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    meta = reader.fields
    where = {"gguf_file": gguf_path.name, "local_files_only": True}
    try:
        hf = AutoTokenizer.from_pretrained(str(gguf_path.parent), **where)
    except ValueError as e:
        if "is not supported yet" not in str(e):
            raise ValueError(f"cannot build a tokenizer from {gguf_path}: {e}") from e
        # transformers reads no config of this architecture (OLMoE, SmolLM3): its tokenizer
        # fields are the same as every other's, built without the config
        try:
            hf = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), **where)
        except Exception as e2:
            raise ValueError(f"cannot build a tokenizer from {gguf_path}: {e2}") from e2
    except Exception as e:
        raise ValueError(f"cannot build a tokenizer from {gguf_path}: {e}") from e
    hf.save_pretrained(str(out_dir))

    # transformers' GPT2Tokenizer adds "<|endoftext|>" as a default special token even when the
    # vocabulary lacks it, growing the tokenizer past the model's embedding; keep GGUF tokens only.
    spec = json.loads((out_dir / "tokenizer.json").read_text(encoding="utf-8"))
    n_tokens = reader.lengths["tokenizer.ggml.tokens"]
    spec["added_tokens"] = [t for t in spec.get("added_tokens", []) if t["id"] < n_tokens]
    raw = RawTokenizer.from_str(json.dumps(spec))
    if meta.get("tokenizer.ggml.model") == "gpt2" and meta.get("tokenizer.ggml.pre") in _DIGIT_SPLIT_PRE:
        raw.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", hf.add_bos_token))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    special: dict[str, tuple[str, int]] = {}
    for kind, flag in (("bos", add_bos), ("eos", add_eos)):
        token_id = meta.get(f"tokenizer.ggml.{kind}_token_id")
        if flag and token_id is not None:
            special[kind] = (hf.convert_ids_to_tokens(int(token_id)), int(token_id))

    def template(seq: str, type_id: int) -> str:
        parts = [f"{special[k][0]}:{type_id}" for k in ("bos",) if k in special] + [f"${seq}:{type_id}"]
        return " ".join(parts + [f"{special[k][0]}:{type_id}" for k in ("eos",) if k in special])

    raw.post_processor = processors.TemplateProcessing(
        single=template("A", 0),
        pair=f"{template('A', 0)} {template('B', 1)}",
        special_tokens=list(special.values()),
    )
    raw.save(str(out_dir / "tokenizer.json"))

    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(add_bos_token=add_bos, add_eos_token=add_eos, clean_up_tokenization_spaces=False)
    cfg.update(tokenizer_class="PreTrainedTokenizerFast")
    for key in ("is_local", "local_files_only"):
        cfg.pop(key, None)
    template = meta.get("tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    if not isinstance(template, str):
        return []
    vocab = hf.get_vocab()
    written = (text for text in _TURN_END_TEXTS if text in template)
    return [vocab[text] for text in written if vocab.get(text, n_tokens) < n_tokens]


if __name__ == "__main__":  # convert_gguf_apart's child: python -m tokenwire.model.gguf GGUF OUT_DIR
    try:
        convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))
    except Exception as exc:
        print(json.dumps({"type": type(exc).__name__, "message": str(exc)}))
        sys.exit(1)
