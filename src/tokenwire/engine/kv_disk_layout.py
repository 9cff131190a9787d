"""What a KV block file holds and whose it is (engine/persistence.py writes and reads them,
engine/kv_disk.py keeps the files): a block's payload is the cache's tensors of that block,
every layer, as stored; the files' namespace is a hash of everything that must match for stored
KV to be this engine's (the model file's content, weight format, KV dtype, block size, device
and ENGINE_ARITHMETIC)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tokenwire.engine.kv_cache import KVCache
from tokenwire.engine.kv_disk import ENGINE_ARITHMETIC, MAGIC

if TYPE_CHECKING:
    from tokenwire.model.loader import ModelSource

HASH_CHUNK = 8 << 20


# ---------------------------------------------------------------------- block payloads
def block_tensors(kv: KVCache) -> list[torch.Tensor]:
    pool = kv.pool
    return [t for t in (pool.k, pool.v, pool.k_scale, pool.v_scale) if t is not None]


def block_payload_bytes(kv: KVCache) -> int:
    return sum(t[:, 0].numel() * t.element_size() for t in block_tensors(kv))


def read_block(kv: KVCache, block: int) -> bytes:
    """A block's keys and values (and q8 scales), every layer, as stored."""
    parts = [t[:, block].contiguous().cpu().view(torch.uint8).reshape(-1) for t in block_tensors(kv)]
    return torch.cat(parts).numpy().tobytes()


def write_block(kv: KVCache, block: int, payload: memoryview) -> None:
    raw = torch.frombuffer(payload, dtype=torch.uint8)  # the read's own buffer: no copy
    offset = 0
    for t in block_tensors(kv):
        target = t[:, block]
        n = target.numel() * t.element_size()
        target.copy_(raw[offset : offset + n].view(t.dtype).view(target.shape))
        offset += n


# ---------------------------------------------------------------------- identities
def kv_namespace(model_id: str, weights: str | None, kv: KVCache, device: str) -> str:
    """The block files' directory: what must all match for stored KV to be this engine's."""
    parts = (model_id, weights, kv.kv_dtype, kv.block_size, device, ENGINE_ARITHMETIC, MAGIC.hex())
    ident = "\0".join(str(p) for p in parts)
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def model_identity(source: ModelSource, state_dir: Path) -> str:
    """A hash of the model's files' content (the GGUF, or the directory's config and weights),
    remembered in <state dir>/model_hashes.json by path, size and mtime so it is read once."""
    files = [source.gguf] if source.gguf is not None else sorted(source.model_dir.glob("*.safetensors"))
    files = [*files, source.model_dir / "config.json"]
    memo_path = state_dir / "model_hashes.json"
    try:
        memo: dict[str, str] = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    whole = hashlib.sha256()
    for path in files:
        if not path.is_file():
            continue
        st = path.stat()
        key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        if key not in memo:
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(HASH_CHUNK):
                    digest.update(chunk)
            memo[key] = digest.hexdigest()
        whole.update(memo[key].encode())
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        memo_path.write_text(json.dumps(memo, indent=1) + "\n")
    except OSError:
        pass  # only a cache
    return whole.hexdigest()[:32]
