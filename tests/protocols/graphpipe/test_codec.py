"""The codec against itself (property tests) and against Oracle's client encoding."""

from __future__ import annotations

import flatbuffers
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tokenwire.protocols.graphpipe.codec import (
    CodecError,
    ErrorInfo,
    InferRequest,
    IOMetadata,
    MetadataRequest,
    MetadataResponse,
    build_infer_response,
    decode_infer_response,
    decode_metadata_response,
    decode_request,
    encode_infer_request,
    encode_infer_response,
    encode_metadata_request,
    encode_metadata_response,
)
from tokenwire.protocols.graphpipe.tensor_codec import add_tensor, finish, new_builder
from tokenwire.protocols.graphpipe.types import Type

# Oracle's client passes the deprecated EndVector(n) to the current flatbuffers runtime
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
convert = pytest.importorskip("graphpipe.convert")

DTYPES = ["u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8", "f2", "f4", "f8"]
shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)
numeric_arrays = st.sampled_from(DTYPES).flatmap(lambda dt: hnp.arrays(np.dtype("<" + dt), shapes))
string_arrays = shapes.flatmap(lambda shape: hnp.arrays(object, shape, elements=st.binary(max_size=12)))


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@settings(max_examples=150, deadline=None)
@given(arrays=st.lists(numeric_arrays | string_arrays, min_size=1, max_size=4), config=st.binary(max_size=20))
def test_infer_request_round_trip(arrays: list[np.ndarray], config: bytes) -> None:
    names = [f"in{i}" for i in range(len(arrays))]
    req = InferRequest(arrays, names, ["out"], config)
    got = decode_request(bytes(encode_infer_request(req)))
    assert isinstance(got, InferRequest)
    assert got.input_names == names and got.output_names == ["out"] and got.config == config
    for sent, back in zip(arrays, got.inputs, strict=True):
        if sent.dtype == object:
            assert back.dtype == object and back.shape == sent.shape and back.tolist() == sent.tolist()
        else:  # bit-exact, NaNs included
            assert _same(sent, back)


@settings(max_examples=100, deadline=None)
@given(arrays=st.lists(numeric_arrays, min_size=1, max_size=3))
def test_oracle_decodes_our_response_and_we_decode_its_request(arrays: list[np.ndarray]) -> None:
    # our InferResponse read by Oracle's client code
    outs, errors = convert.deserialize_infer_response(bytes(encode_infer_response(arrays)))
    assert errors == []
    for sent, back in zip(arrays, outs, strict=True):
        assert _same(sent.astype(sent.dtype.newbyteorder("=")), back)
    # Oracle's request read by our decoder, and ours (alignment 1, same builder order) byte-equal
    oracle_bytes = bytes(
        convert.serialize_infer_request(convert.InferReq("{}", arrays, ["a"] * len(arrays), ["y"]))
    )
    ours = bytes(
        encode_infer_request(InferRequest(arrays, ["a"] * len(arrays), ["y"], b"{}"), data_alignment=1)
    )
    assert ours == oracle_bytes
    got = decode_request(oracle_bytes)
    assert isinstance(got, InferRequest)
    assert all(_same(s, b) for s, b in zip(arrays, got.inputs, strict=True))


def test_string_tensors_cross_decode() -> None:
    arr = np.array([["héllo", "", "x\x00y"], ["a", "bb", "ccc"]], dtype=object)
    ours = bytes(encode_infer_request(InferRequest([arr], ["s"], [], b""), data_alignment=1))
    oracle = bytes(convert.serialize_infer_request(convert.InferReq(None, [arr], ["s"], None)))
    assert ours == oracle
    got = decode_request(oracle)
    assert isinstance(got, InferRequest)
    assert got.inputs[0].tolist() == [[s.encode() for s in row] for row in arr.tolist()]
    outs, _ = convert.deserialize_infer_response(bytes(encode_infer_response([arr])))
    assert outs[0].tolist() == [[s.encode() for s in row] for row in arr.tolist()]


def test_decoded_tensor_is_a_view_on_the_request_buffer() -> None:
    x = np.arange(1000, dtype=np.float32).reshape(10, 100)
    body = bytes(encode_infer_request(InferRequest([x], ["x"])))
    got = decode_request(body)
    assert isinstance(got, InferRequest)
    buf = np.frombuffer(body, np.uint8)
    assert np.shares_memory(got.inputs[0], buf)  # no copy of the payload
    assert got.inputs[0].flags.aligned and not got.inputs[0].flags.writeable
    assert np.array_equal(got.inputs[0], x)


def test_big_endian_input_is_written_little_endian() -> None:
    x = np.arange(6, dtype=">i4").reshape(2, 3)
    got = decode_request(bytes(encode_infer_request(InferRequest([x]))))
    assert isinstance(got, InferRequest)
    assert got.inputs[0].dtype == np.dtype("<i4") and got.inputs[0].tolist() == x.tolist()


def test_metadata_round_trip_and_oracle_reads_it() -> None:
    meta = MetadataResponse(
        "m", "1.0", "tokenwire", "desc",
        [IOMetadata("x", Type.Float32, [-1, 3], "input x"), IOMetadata("s", Type.String, [-1])],
        [IOMetadata("y", Type.Int64, [-1, 2, 2])],
    )  # fmt: skip
    body = bytes(encode_metadata_response(meta))
    assert decode_metadata_response(body) == meta
    m = convert.deserialize_metadata_response(body)
    assert m.Name() == b"m" and m.Inputs(0).Name() == b"x" and m.Inputs(0).Type() == Type.Float32
    assert m.Inputs(0).ShapeAsNumpy().tolist() == [-1, 3] and m.Outputs(0).Type() == Type.Int64
    assert isinstance(decode_request(bytes(encode_metadata_request())), MetadataRequest)
    assert isinstance(decode_request(bytes(convert.serialize_metadata_request())), MetadataRequest)


def test_errors_response_read_by_oracle() -> None:
    body = bytes(encode_infer_response(errors=[ErrorInfo(4, "input 'x' must be Float32")]))
    outs, errors = convert.deserialize_infer_response(body)
    assert outs == [] and errors == [{"code": 4, "message": b"input 'x' must be Float32"}]
    assert decode_infer_response(body).errors == [ErrorInfo(4, "input 'x' must be Float32")]


# ------------------------------------------------------------------ malformed tensors
def _raw_tensor(type_id: int, shape: list[int], data: bytes | None, strings: list[bytes] | None) -> bytes:
    """A Request holding one hand-built (possibly inconsistent) tensor."""
    b = flatbuffers.Builder(1024)
    string_offsets = [b.CreateString(s) for s in reversed(strings or [])]
    data_off = b.CreateByteVector(data) if data is not None else None
    sv = None
    if strings is not None:
        b.StartVector(4, len(string_offsets), 4)
        for o in string_offsets:
            b.PrependUOffsetTRelative(o)
        sv = b.EndVector()
    b.StartVector(8, len(shape), 8)
    for d in reversed(shape):
        b.PrependInt64(d)
    shape_off = b.EndVector()
    b.StartObject(4)
    b.PrependUint8Slot(0, type_id, 0)
    b.PrependUOffsetTRelativeSlot(1, shape_off, 0)
    if data_off is not None:
        b.PrependUOffsetTRelativeSlot(2, data_off, 0)
    if sv is not None:
        b.PrependUOffsetTRelativeSlot(3, sv, 0)
    tensor = b.EndObject()
    b.StartVector(4, 1, 4)
    b.PrependUOffsetTRelative(tensor)
    tensors = b.EndVector()
    b.StartObject(4)
    b.PrependUOffsetTRelativeSlot(2, tensors, 0)
    infer = b.EndObject()
    b.StartObject(2)
    b.PrependUint8Slot(0, 1, 0)
    b.PrependUOffsetTRelativeSlot(1, infer, 0)
    return bytes(finish(b, b.EndObject()))


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        ((Type.Float32, [2, 3], b"\0" * 20, None), "needs 24 bytes of data, got 20"),
        ((Type.Int64, [4], b"\0" * 40, None), "needs 32 bytes"),
        ((Type.Float32, [1], b"\0" * 4, [b"a"]), "both data and string_val are set"),
        ((Type.String, [3], None, [b"a", b"b"]), "needs 3 strings, string_val has 2"),
        ((Type.String, [1], b"\0", None), "carries 1 bytes of data"),
        ((Type.Int8, [1], None, [b"a"]), "carries string_val instead of data"),
        ((Type.Null, [1], b"\0", None), "unsupported tensor type Null"),
        ((13, [1], b"\0", None), "unsupported tensor type unknown type 13"),
        ((Type.Uint8, [-1, 2], b"\0\0", None), "negative dimension"),
    ],
)
def test_inconsistent_tensors_are_errors(tensor: tuple, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        decode_request(_raw_tensor(*tensor))


@pytest.mark.parametrize("body", [b"", b"abc", b"\xff" * 64, b"\x08\x00\x00\x00" + b"\x00" * 12])
def test_garbage_is_a_codec_error(body: bytes) -> None:
    with pytest.raises(CodecError):
        decode_request(body)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_corrupted_requests_never_crash_the_decoder(data: st.DataObject) -> None:
    body = bytearray(encode_infer_request(InferRequest([np.arange(6, dtype=np.int32)], ["x"], ["y"], b"c")))
    for _ in range(data.draw(st.integers(1, 4))):
        body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    try:
        decode_request(bytes(body))
    except CodecError:
        pass  # the only failure a corrupt body may cause


def test_encoding_writes_payload_into_the_builder() -> None:
    x = np.arange(64, dtype=np.float64)
    b = new_builder(4096)
    offset = add_tensor(b, x)
    view = finish(b, offset)
    assert isinstance(view, memoryview) and view.obj is b.Bytes.obj  # no final copy of the buffer
    body = bytes(encode_infer_response([x]))
    assert decode_infer_response(body).outputs[0].tolist() == x.tolist()


# ------------------------------------------------------------------ the fast response writer
def _views(arr: np.ndarray) -> st.SearchStrategy[np.ndarray]:
    """The array itself, a strided view of it, or a byte-swapped copy: all must encode alike."""
    swapped = arr.astype(arr.dtype.newbyteorder(">" if arr.dtype.byteorder != ">" else "<"))
    return st.sampled_from([arr, arr[::-1] if arr.ndim else arr, arr.T, swapped])


@settings(max_examples=150, deadline=None)
@given(arrays=st.lists(numeric_arrays.flatmap(_views), min_size=0, max_size=4))
def test_fast_response_writer_round_trips_and_oracle_reads_it(arrays: list[np.ndarray]) -> None:
    body = encode_infer_response(arrays)
    assert isinstance(body, bytearray)  # the precomputed-layout writer, not the Builder
    message = bytes(body)
    ours = decode_infer_response(message)
    oracle, errors = convert.deserialize_infer_response(message)
    generic = decode_infer_response(bytes(build_infer_response(arrays)))
    assert errors == [] and ours.errors == []
    start = np.frombuffer(message, np.uint8).ctypes.data
    for sent, back, theirs, built in zip(arrays, ours.outputs, oracle, generic.outputs, strict=True):
        want = sent.astype(sent.dtype.newbyteorder("<"), order="C")  # what the wire must carry
        assert _same(want, back) and _same(want, built)
        assert theirs.shape == sent.shape and theirs.tobytes() == want.tobytes()
        if back.size:  # a view on the message, its payload 16-byte aligned within it
            assert (back.ctypes.data - start) % 16 == 0


def test_fast_response_writer_large_message() -> None:
    x = np.random.default_rng(3).standard_normal((3, 200_000)).astype(np.float32)  # 2.4 MB
    ids = np.arange(10, dtype=np.int64).reshape(2, 5)
    body = encode_infer_response([x, ids])
    assert isinstance(body, memoryview)  # large: written into uninitialised memory, no zero pass
    got = decode_infer_response(bytes(body))
    assert _same(x, got.outputs[0]) and _same(ids, got.outputs[1])
    oracle, _ = convert.deserialize_infer_response(bytes(body))
    assert np.array_equal(oracle[0], x) and oracle[1].tolist() == ids.tolist()


def test_fast_response_writer_refuses_types_without_a_wire_type() -> None:
    with pytest.raises(TypeError, match="no GraphPipe type"):
        encode_infer_response([np.zeros(3, dtype=bool)])
