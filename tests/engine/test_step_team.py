"""Issue 31: the layers of a step outside the fused decode kernel (prefill chunks, mixed batches)
run on one thread while the cores are contended, decided per layer from the team's CPU time
missing from threads x wall; one thread gives the team's results bit for bit."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from tokenwire.engine.request import GenerateOptions, SamplingParams
from tokenwire.engine.step_team import MIN_ROWS, StepTeam
from tokenwire.model import kernels
from tokenwire.model.layers.block import DecoderLayer

STEP_GATE = 1  # team_state's index of the unfused steps' gate (kernels/barrier.h)
FUSED_GATE = 0  # the fused stack's


@pytest.fixture
def gate():
    if torch.get_num_threads() < 2:
        pytest.skip("needs two threads for a team")
    kernels.load_kernels()
    ops = kernels.ops()
    ops.set_team_mode(1)  # adaptive, nothing learnt
    yield ops
    ops.set_team_mode(1)


class Probe(DecoderLayer):
    """A layer that records the threads it ran with; `away` makes it wait without using a CPU,
    as a team does whose partner is off its core."""

    def __init__(self, seen: list[int]) -> None:
        nn.Module.__init__(self)  # the hooks' kind of layer, without its weights
        self.seen = seen
        self.away = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.get_num_threads())
        if self.away:
            time.sleep(0.02)
        return x


class Stack(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.seen: list[int] = []
        self.layers = nn.ModuleList(Probe(self.seen) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_contended_layers_go_solo_and_the_step_gives_its_threads_back(gate) -> None:
    full = torch.get_num_threads()
    stack = Stack(6)
    team = StepTeam(stack, enabled=True)
    x = torch.zeros(1)
    for layer in stack.layers:
        layer.away = True
    with team.step(MIN_ROWS):
        stack(x)
    # two contended layers in a row start a solo span (8 layers), the rest of the step runs on one
    assert stack.seen == [full, full, 1, 1, 1, 1], stack.seen
    assert torch.get_num_threads() == full  # the step's end restores the team
    assert gate.team_state(STEP_GATE)[1] == 4  # solo layers still due

    stack.seen.clear()
    gate.set_team_mode(1)
    with team.step(MIN_ROWS - 1):  # too few rows to judge: follows the gate, reports nothing
        stack(x)
    assert stack.seen == [full] * 6
    assert gate.team_state(STEP_GATE)[1] == 0
    stack.seen.clear()
    stack(x)  # outside a step (the fused path, direct model calls): untouched
    assert stack.seen == [full] * 6


def test_one_thread_prefills_as_the_team_does(smollm2_engine, gate) -> None:
    """The fused steps (prefill chunks and decode alike) forced onto one thread: the same
    tokens and logprobs, prompt positions included, bit for bit (the kernels split rows, not
    sums)."""
    engine = smollm2_engine
    text = " ".join(f"Item {i} goes on shelf {i * 7 % 13}." for i in range(60))
    prompt = engine.tokenizer.encode(text)[:300]
    options = GenerateOptions(
        max_tokens=8,
        sampling=SamplingParams(temperature=0.0),
        ignore_eos=True,
        use_prefix_cache=False,
        logprobs=True,
        logprob_ranges=((0, len(prompt) + 8),),
        speculate=False,  # one step a token: the steps counted below
    )
    gate.set_team_mode(0)  # always the team
    team = engine.generate(None, prompt, options).result()
    before = gate.team_state(FUSED_GATE)
    gate.set_team_mode(2)  # always one thread
    solo = engine.generate(None, prompt, options).result()
    after = gate.team_state(FUSED_GATE)
    assert after[2] - before[2] >= 8  # the prefill chunk and the decode steps ran solo
    assert after[3] == before[3]
    assert solo == team
