"""Writes tests/data/llama_cpp_converter_tables.json: what llama.cpp's own convert_hf_to_gguf.py
writes for each tiny family of tests/model/test_family_gguf.py (F32 and Q8_0): its metadata
(every key but general.* and the tokenizer's) and its tensor table (name, shape, type).
tests/model/test_family_gguf.py holds our test writer (tests/model/converter_gguf.py) to it, so
the files the family tests load are the files users convert.

    PYTHONPATH=src:. .venv/bin/python tests/data/make_converter_tables.py

Each converted file must also load into our engine as its Hugging Face directory (the checks of
the family tests: logits, greedy tokens). Needs PyPI (the llama-cpp-python sdist carries the
converter and its gguf-py; the converter imports sentencepiece). Not run by the tests (they read
the committed JSON). Last run 2026-11-26: llama-cpp-python 0.3.36's converter, transformers 5.24.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tests.model.test_family_gguf import FAMILIES, QUANTS, assert_loads_as, gguf_table
from tests.tiny_models import hf_model
from tokenwire.model.loader import resolve_model

OUT = Path(__file__).with_name("llama_cpp_converter_tables.json")
SDIST = "llama-cpp-python==0.3.36"


def converter(work: Path) -> Path:
    """The sdist's vendored llama.cpp: convert_hf_to_gguf.py, conversion/ and gguf-py/."""
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "download", SDIST, "--no-deps", "--no-binary", ":all:", "-d", work], check=True)
    subprocess.run([*pip, "install", "--quiet", "--target", work / "site", "sentencepiece"], check=True)
    with tarfile.open(next(work.glob("llama_cpp_python-*.tar.gz"))) as tar:
        root = tar.getnames()[0].split("/")[0] + "/vendor/llama.cpp/"
        wanted = tuple(root + w for w in ("convert_hf_to_gguf.py", "conversion/", "gguf-py/"))
        tar.extractall(work, [m for m in tar.getmembers() if m.name.startswith(wanted)])
    return work / root


def hf_directory(family: str, out: Path) -> None:
    hf_model(family).save_pretrained(out)
    tokenizer_dir = resolve_model(None).model_dir  # the shipped SmolLM2 tokenizer, as the tests use
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    if family == "phi3":  # Phi-4's BPE vocabulary: the converter reads it when the class says GPT-2
        config = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))


def main() -> None:
    tables: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        llama_cpp = converter(work)
        env = {"PYTHONPATH": f"{llama_cpp / 'gguf-py'}:{llama_cpp}:{work / 'site'}", "PATH": "/usr/bin:/bin"}
        for family in FAMILIES:
            hf_directory(family, work / family)
            for quant in QUANTS:
                path = work / f"{family}-{quant}.gguf"
                script = llama_cpp / "convert_hf_to_gguf.py"
                cmd = [sys.executable, script, work / family, "--outtype", quant.lower(), "--outfile", path]
                subprocess.run(cmd, check=True, env=env)
                tables[f"{family}/{quant}"] = gguf_table(path)
                assert_loads_as(hf_model(family), path, quant, work / "cache")
    OUT.write_text(json.dumps(tables, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
