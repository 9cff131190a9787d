"""The step's three parts (engine/step.py) on a one-layer toy cache: the inputs gathered from the
scheduler's items, the attention chosen by the model's can_fuse_decode, the model run through
StepModel; and StepModel's check at load. Bit-exactness is test_batch_invariance.py's and
test_engine_parity.py's (the same steps on real tiny models)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from tests.engine.test_scheduler import TINY, _request
from tokenwire.bench.random_tokens import RandomTokenModel
from tokenwire.engine.attention import PagedAttention
from tokenwire.engine.kv_cache import KVCache
from tokenwire.engine.request import SamplingParams
from tokenwire.engine.scheduler import Scheduler
from tokenwire.engine.step import StepItem, choose_attention, gather_inputs, run_step
from tokenwire.engine.step_model import check_step_model
from tokenwire.model.layers.decoder import PagedDecode


def _items(kv: KVCache) -> list[StepItem]:
    """A decode (request 1, 6 tokens computed) and a 5-token prefill (request 2) in one step."""
    scheduler = Scheduler(kv, max_batch_tokens=64, max_running=8, idle_sessions=list)
    decoding = _request(1, 6, priority=0)
    scheduler.add(decoding)
    scheduler.schedule(lambda request, error: None)
    decoding.session.computed(6, kv)
    decoding.session.tokens.append(7)
    prefill = _request(2, 5, priority=0)
    # greedy and with logprobs: its sampled row gets row stats with a logsumexp
    prefill.options = replace(prefill.options, sampling=SamplingParams(temperature=0.0), logprobs=True)
    scheduler.add(prefill)
    return scheduler.schedule(lambda request, error: None)


class _Model(RandomTokenModel):
    def __init__(self, fuse: bool) -> None:
        super().__init__(TINY)
        self.fuse = fuse

    @property
    def can_fuse_decode(self) -> bool:  # type: ignore[override]
        return self.fuse


def test_the_inputs_are_the_items_rows_in_packed_order() -> None:
    kv = KVCache(TINY, 8, 4, "fp32", "cpu")
    decode, prefill = _items(kv)
    step = gather_inputs([decode, prefill], kv.block_size)
    assert step.ids == [7, *prefill.request.session.tokens]
    assert step.positions == [6, 0, 1, 2, 3, 4]
    table = decode.request.session.block_table
    assert step.slots[0] == table[1] * 4 + 2  # position 6: block 1, offset 2
    assert [(b.rows, b.start) for b in step.items] == [([0], 6), ([1, 2, 3, 4, 5], 0)]
    assert step.items[0].blocks == table[:2] and len(step.items[1].blocks) == 2
    # the decode's row and the prompt's last row sample; only the greedy one gets row stats
    assert step.logit_rows[0] == 0 and step.logit_rows[-1] == 5
    assert step.logit_keys[0] == (1, 6) and step.logit_keys[-1] == (2, 4)
    assert step.stat_rows == [(len(step.logit_rows) - 1, True)]
    assert step.capture_rows == [] and step.window_slots == []


@pytest.mark.parametrize("fuse", [True, False])
def test_the_attention_follows_the_model_and_the_step_runs_through_it(fuse: bool) -> None:
    kv = KVCache(TINY, 8, 4, "fp32", "cpu")
    items = _items(kv)
    model = _Model(fuse)
    step = gather_inputs(items, kv.block_size)
    attention = choose_attention(model, kv, step, torch.tensor(step.positions))
    assert isinstance(attention, PagedDecode if fuse else PagedAttention)
    if fuse:  # a table per row, padded to one width
        assert attention.block_tables.shape == (6, 2)
    out = run_step(model, kv, items, ())
    assert list(out.logits) == step.logit_keys and list(out.stats) == [(2, 4)]
    for (rid, p), row in out.logits.items():  # RandomTokenModel: a row of its table by (token, position)
        session = items[rid - 1].request.session
        assert torch.equal(row, model.logits(torch.tensor([(session.tokens[p] * 31 + p) % 257]))[0])


def test_a_model_without_what_a_step_needs_is_refused_naming_it() -> None:
    model = RandomTokenModel(TINY)
    assert check_step_model(model) is model
    with pytest.raises(
        TypeError, match="Linear cannot run engine steps: it has no config, dtype, can_fuse_decode, logits"
    ):
        check_step_model(nn.Linear(2, 2))
