"""The seed's three examples, message for message (text format, published field names), end to
end on the default model. The video refs of example 1 are files under an allowed ref root."""

from __future__ import annotations

from google.protobuf import text_format

from tests.protocols.evergreen.conftest import check_output_stream, text_of
from tokenwire.protocols.evergreen.gen import evergreen_service_pb2 as spb

GENERATE_CONFIG = (
    "[type.googleapis.com/tokenwire.evergreen.v1.GenerateConfig] { max_tokens: 12 temperature: 0 }"
)


def msg(text: str) -> spb.SessionMessage:
    return text_format.Parse(text, spb.SessionMessage())


EXAMPLE_1_TURN_1 = [
    """actions { name: "GENERATE" inputs { name: "prompt" id: "prompt_1" }
                outputs { name: "response" id: "response_1" } }""",
    """node_fragments { id: "prompt_1" child_ids: "question_1" child_ids: "video_1" }""",
    """node_fragments { id: "question_1" chunk_fragment {
         metadata { mimetype: "text/plain" } data: "Write a summary of this video: " } }""",
    """node_fragments { id: "video_1" seq: 0 continued: true chunk_fragment {
         metadata { mimetype: "video/mp4" } ref: "file://path/to/file/part1" } }""",
    """node_fragments { id: "video_1" seq: 1 chunk_fragment {
         metadata { mimetype: "video/mp4" } ref: "file://path/to/file/part2" } }""",
]
EXAMPLE_1_TURN_2 = [
    """actions { name: "GENERATE" inputs { name: "prompt" id: "prompt_2" }
                outputs { name: "response" id: "response_2" } }""",
    """node_fragments { id: "prompt_2"
         child_ids: "prompt_1" child_ids: "response_1" child_ids: "question_2" }""",
    """node_fragments { id: "question_2" chunk_fragment {
         metadata { mimetype: "text/plain" } data: "Who's winning?" } }""",
]


def greedy_reply(engine, user_text: str, max_tokens: int = 12) -> str:
    """The oracle: the engine itself, greedy, on the chat template of one user turn."""
    from tokenwire.engine.request import GenerateOptions, SamplingParams

    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": user_text}])
    options = GenerateOptions(max_tokens=max_tokens, sampling=SamplingParams(temperature=0))
    tokens, _ = engine.generate(None, prompt, options).result()
    return "".join(t.text for t in tokens)


def test_example_1_long_video_two_turns_reuses_turn_1(conversation, smollm2_engine):
    c = conversation()
    for text in EXAMPLE_1_TURN_1:
        c.requests.put(msg(text))
    response_1 = c.read_until_final("response_1")
    check_output_stream(response_1, "response_1")
    assert text_of(response_1).strip()

    before = smollm2_engine.stats()["computed_tokens"]
    for text in EXAMPLE_1_TURN_2:
        c.requests.put(msg(text))
    response_2 = c.read_until_final("response_2")
    computed = smollm2_engine.stats()["computed_tokens"] - before
    check_output_stream(response_2, "response_2")
    assert c.close() == []

    tok = smollm2_engine.tokenizer
    # What turn 2 adds after turn 1's prompt and response (ChatML: end of the assistant turn,
    # the user turn, the generation prompt).
    new = tok.encode(
        "<|im_end|>\n<|im_start|>user\nWho's winning?<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )
    generated = len(tok.encode(text_of(response_2), add_special_tokens=False))
    turn_1_context = len(tok.encode("Write a summary of this video: ", add_special_tokens=False)) + 30
    # only the new tokens are prefilled (1 token may be recomputed for its logits), then decode
    assert computed <= len(new) + 1 + generated + 2, (computed, len(new), generated)
    assert computed < turn_1_context + len(new)


def test_example_2_customized_generate(conversation, smollm2_engine):
    c = conversation()
    c.requests.put(
        msg(f"""actions {{ name: "GENERATE" configs {{ {GENERATE_CONFIG} }}
        inputs {{ name: "text" id: "prompt_1" }} outputs {{ name: "text" id: "response_1" }} }}""")
    )
    c.requests.put(
        msg("""node_fragments { id: "prompt_1" child_ids: "prompt_1_text" child_ids: "prompt_1_eot" }""")
    )
    c.requests.put(
        msg("""node_fragments { id: "prompt_1_text" chunk_fragment { metadata { mimetype: "text/plain" }
        data: "Write a heroic novel about a half-eaten jam doughnut." } }""")
    )
    c.requests.put(
        msg("""node_fragments { id: "prompt_1_eot" chunk_fragment {
        metadata { mimetype: "application/x-protobuf; type=EndOfTurn" } } }""")
    )
    response = c.read_until_final("response_1")
    check_output_stream(response, "response_1")
    assert text_of(response) == greedy_reply(
        smollm2_engine, "Write a heroic novel about a half-eaten jam doughnut."
    )
    assert c.close() == []


def test_example_3_streamed_chain(conversation, smollm2_engine):
    c = conversation()
    c.requests.put(
        msg(f"""actions {{ name: "GENERATE" configs {{ {GENERATE_CONFIG} }}
        inputs {{ name: "text" id: "prompt_1" }} outputs {{ name: "text" id: "response_1" }} }}""")
    )
    c.requests.put(msg("""node_fragments { id: "prompt_1" child_ids: "prompt_1_text" continued: true }"""))
    c.requests.put(
        msg("""node_fragments { id: "prompt_1_text" chunk_fragment { metadata { mimetype: "text/plain" }
        data: "Write a heroic novel about a half-eaten jam doughnut." } }""")
    )
    c.requests.put(msg("""node_fragments { id: "prompt_1" child_ids: "prompt_1_eot" seq: 1 }"""))
    c.requests.put(
        msg("""node_fragments { id: "prompt_1_eot" chunk_fragment {
        metadata { mimetype: "application/x-protobuf; type=EndOfTurn" } } }""")
    )
    response = c.read_until_final("response_1")
    check_output_stream(response, "response_1")
    assert text_of(response) == greedy_reply(
        smollm2_engine, "Write a heroic novel about a half-eaten jam doughnut."
    )
    assert c.close() == []
