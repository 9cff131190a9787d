"""Our GGUF header reader gives what gguf-py's GGUFReader gives (metadata, and each tensor's
type, shape, offset and size), skipping only the vocabulary's arrays, whose lengths it keeps;
a damaged file is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFReader

from tokenwire.model.gguf_header import read_header

DATA = Path(__file__).parents[1] / "data"
SKIPPED = {f"tokenizer.ggml.{k}" for k in ("tokens", "merges", "scores", "token_type")}


@pytest.mark.parametrize("which", ["shipped", "kquant"])
def test_header_matches_gguf_py(which: str, smollm2_source) -> None:
    path = smollm2_source.source if which == "shipped" else DATA / "tiny-llama-Q4_K_M.gguf"
    ours, theirs = read_header(path), GGUFReader(path)
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):  # the reader's own entries (version, counts)
            continue
        if key in SKIPPED:
            assert ours.lengths[key] == len(field.data)
        else:
            assert ours.fields[key] == field.contents(), key
    assert len(ours.tensors) == len(theirs.tensors)
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert (mine.qtype, mine.offset, mine.nbytes) == (t.tensor_type, t.data_offset, t.n_bytes)
        assert mine.shape == tuple(int(d) for d in reversed(t.shape.tolist()))


def test_damaged_files_are_refused_by_name(tmp_path: Path) -> None:
    whole = (DATA / "tiny-llama-Q4_K_M.gguf").read_bytes()
    cases = {"not-gguf": b"GGML" + whole[4:], "cut-header": whole[:300], "cut-data": whole[: len(whole) // 2]}
    for name, data in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises(ValueError, match=f"cannot read GGUF file {path}"):
            read_header(path)
