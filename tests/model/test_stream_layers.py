"""A float model run a layer at a time (families.build_model's `stream_layers`, the fp32
reference of `bench quality`): each decoder layer's weights are read from the file as it runs and
dropped after it, and the logits are those of the model loaded whole, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.model.converter_gguf import write_like_llama_cpp
from tests.model.test_llama_parity import dense_logits
from tests.tiny_models import hf_model
from tokenwire.engine.factory import load_model
from tokenwire.model.families import build_model
from tokenwire.model.gguf_weights import GgufWeights
from tokenwire.model.layers.decoder import DecoderModel
from tokenwire.model.loader import resolve_model


def loaded_layers(model: DecoderModel) -> list[int]:
    """The layers whose weights are in memory (any parameter or buffer not on the meta device)."""
    return [
        i
        for i, layer in enumerate(model.layers)
        if any(not t.is_meta for t in [*layer.parameters(), *layer.buffers()])
    ]


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One conversions' cache for the module: the files share the shipped tokenizer, converted once."""
    return tmp_path_factory.mktemp("cache")


# a dense family with a tied head, Gemma 3's sandwich norms and sliding window, and experts
@pytest.mark.parametrize("arch", ["smollm3", "gemma3_gguf", "olmoe"])
def test_a_streamed_model_gives_the_whole_models_logits_one_layer_in_memory_at_a_time(
    tmp_path: Path, shared_cache: Path, arch: str
) -> None:
    path = tmp_path / f"tiny-{arch}.gguf"
    write_like_llama_cpp(hf_model(arch), path, "Q8_0")
    source = resolve_model(path, cache_dir=shared_cache)
    whole = load_model(source, "fp32", torch.device("cpu"), None)
    streamed = load_model(source, "fp32", torch.device("cpu"), None, stream_layers=True)
    assert loaded_layers(whole) == list(range(len(whole.layers)))
    assert loaded_layers(streamed) == []  # nothing of the layers read before the pass

    seen: list[list[int]] = []
    for layer in streamed.layers:
        layer.register_forward_hook(lambda module, args, out: seen.append(loaded_layers(streamed)))
    ids = torch.randint(3, 49152, (2, 30), generator=torch.Generator().manual_seed(3))
    expected = dense_logits(whole, ids)
    for _ in range(2):  # a second pass reads the layers again
        seen.clear()
        assert torch.equal(dense_logits(streamed, ids), expected)
        # the hooks run in registration order: the loader's drop came first, so at each
        # layer's end none is resident any more; at its start only it was (below)
        assert seen == [[]] * len(streamed.layers)

    during: list[list[int]] = []
    for layer in streamed.layers:
        layer.register_forward_pre_hook(lambda module, args: during.append(loaded_layers(streamed)))
    dense_logits(streamed, ids)
    assert during == [[i] for i in range(len(streamed.layers))]


def test_quantised_weights_are_not_streamed(tmp_path: Path, shared_cache: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_like_llama_cpp(hf_model("smollm3"), path, "Q8_0")
    source = resolve_model(path, cache_dir=shared_cache)
    blocks = GgufWeights(path, source.config)
    with pytest.raises(ValueError, match="stream_layers runs float weights"):
        build_model(source.config, blocks, blocks.qtypes, stream_layers=True)
