from __future__ import annotations

from typing import Any

from tokenwire.engine.request import GenerateOptions, SamplingParams


def generate(stub: Any, pb: Any, **fields: Any) -> tuple[list[Any], Any]:
    """One Generate call: its Token messages and its GenerateDone."""
    for name in ("logprobs_ranges", "readout_ranges"):
        if name in fields:
            fields[name] = [pb.PositionRange(start=s, end=e) for s, e in fields[name]]
    tokens, done = [], None
    for event in stub.Generate(pb.GenerateRequest(**fields)):
        if event.HasField("token"):
            assert done is None, "a Token after Done"
            tokens.append(event.token)
        else:
            done = event.done
    assert done is not None, "the stream ended without Done"
    return tokens, done


def engine_greedy(
    engine: Any, prompt: list[int], max_tokens: int, top: int = 0
) -> tuple[list[int], list[float]]:
    """What the engine generates greedily on a fresh sequence, with raw logprobs."""
    opts = GenerateOptions(
        max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0), logprobs=True, top_logprobs=top
    )
    events, _ = engine.generate(None, prompt, opts).result()
    return [e.token_id for e in events], [e.logprob for e in events]


def chat(engine: Any, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
