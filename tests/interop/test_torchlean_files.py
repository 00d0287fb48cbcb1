"""Bit-exact tests for the TorchLean checkpoint files (lean_store.interop.torchlean).

Every reference file here is built by hand with struct/bytes or written out as JSON text, never
produced by the writer under test, so reader and writer are each checked against the spec.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lean_store.errors import CheckpointError, FormatError, IntegrityError
from lean_store.interop.torchlean import (
    STATE_ENCODINGS,
    TLAdamEntry,
    TLAdamFile,
    TLAdamParam,
    TLState,
    binary_tag,
    complex_tag,
    decode_adam,
    decode_sf32,
    decode_state_json,
    encode_adam,
    encode_sf32,
    encode_state_json,
    parse_tag,
    read_adam,
    read_sf32,
    read_state_json,
    write_adam,
    write_sf32,
    write_state_json,
)


def u64(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}Q", *values)


def f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def u32(*words: int) -> bytes:
    return struct.pack(f"<{len(words)}I", *words)


def dbits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


# ---------------------------------------------------------------------------------------------
# TLSF32B
# ---------------------------------------------------------------------------------------------

# One tensor of shape [2] holding [1.0, -2.5]: the spec's 55-byte test vector.
SF32_VECTOR = (
    b"TLSF32B"  # magic, 7 bytes
    + u64(1)  # version
    + u64(1)  # tensor count
    + u64(1)  # rank
    + u64(2)  # dim 0
    + u64(2)  # element count
    + bytes([0x00, 0x00, 0x80, 0x3F, 0x00, 0x00, 0x20, 0xC0])  # 1.0, -2.5 as LE binary32
)

# Three tensors: a scalar, a 2x3 matrix of special values, and an empty [0, 4] tensor.
SPECIAL_WORDS = (0x7FC00001, 0x7F800001, 0xFFFFFFFF, 0x80000000, 0x00000001, 0x7F800000)
SF32_MULTI = (
    b"TLSF32B"
    + u64(1, 3)
    + u64(0, 1)
    + f32(0.5)  # rank 0, count 1
    + u64(2, 2, 3, 6)
    + u32(*SPECIAL_WORDS)
    + u64(2, 0, 4, 0)  # rank 2, dims 0 x 4, count 0, no payload
)


def test_sf32_vector_is_exact() -> None:
    assert len(SF32_VECTOR) == 55
    assert SF32_VECTOR.endswith(bytes.fromhex("0000803f000020c0"))
    hex_dump = (
        "544c5346333242" + "0100000000000000" * 3 + "0200000000000000" * 2 + "0000803f000020c0"
    )
    assert bytes.fromhex(hex_dump) == SF32_VECTOR
    (t,) = read_sf32(SF32_VECTOR)
    assert t.dtype == np.float32 and t.shape == (2,)
    assert t.tolist() == [1.0, -2.5]
    assert encode_sf32([np.array([1.0, -2.5], dtype=np.float32)]) == SF32_VECTOR
    assert encode_sf32([t]) == SF32_VECTOR


def test_sf32_file_round_trip(tmp_path) -> None:
    path = tmp_path / "state.tlsf32"
    write_sf32(path, [np.array([1.0, -2.5], dtype=np.float32)])
    assert path.read_bytes() == SF32_VECTOR
    assert os.listdir(tmp_path) == ["state.tlsf32"]  # no temporary file left behind
    assert read_sf32(str(path))[0].tolist() == [1.0, -2.5]
    assert read_sf32(path)[0].tolist() == [1.0, -2.5]


def test_sf32_preserves_nan_payloads_and_shapes(tmp_path) -> None:
    scalar, special, empty = read_sf32(SF32_MULTI)
    assert scalar.shape == () and scalar.dtype == np.float32 and float(scalar) == 0.5
    assert special.shape == (2, 3)
    assert special.view(np.uint32).ravel().tolist() == list(SPECIAL_WORDS)
    assert empty.shape == (0, 4) and empty.dtype == np.float32
    assert encode_sf32([scalar, special, empty]) == SF32_MULTI
    write_sf32(tmp_path / "m", [scalar, special, empty])
    again = read_sf32(tmp_path / "m")[1]
    assert again.view(np.uint32).ravel().tolist() == list(SPECIAL_WORDS)


def test_sf32_writer_accepts_big_endian_float32_and_rejects_other_dtypes() -> None:
    swapped = np.array([1.0, -2.5], dtype=">f4")
    assert encode_sf32([swapped]) == SF32_VECTOR
    for bad in (np.array([1.0, -2.5]), np.array([1, 2], dtype=np.int32), [1.0, -2.5]):
        with pytest.raises(FormatError, match="tensor 0"):
            encode_sf32([bad])  # type: ignore[list-item]
    with pytest.raises(FormatError):
        write_sf32("/nonexistent-dir/never-created", [np.zeros(2)])  # validated before I/O


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"TLSF32X" + SF32_VECTOR[7:], "wrong magic"),
        (b"XLSF32B" + SF32_VECTOR[7:], "wrong magic"),
        (b"TLSF32B" + u64(0) + SF32_VECTOR[15:], "unsupported version 0"),
        (b"TLSF32B" + u64(2) + SF32_VECTOR[15:], "unsupported version 2"),
        (SF32_VECTOR + b"\x00", "1 trailing bytes"),
        (SF32_VECTOR + SF32_VECTOR, "trailing bytes"),
        (b"TLSF32B" + u64(1, 1, 1, 2, 3) + f32(1.0, -2.5, 0.0), "element count 3"),
        (b"TLSF32B" + u64(1, 1, 1, 2, 1) + f32(1.0), "does not match its dims"),
        (b"TLSF32B" + u64(1, 2) + SF32_VECTOR[23:], "truncated at byte 55: tensor 1 rank"),
        (b"TLSF32B" + u64(1, 3) + SF32_VECTOR[23:], "tensor count 3 at byte 15"),
        (b"", "truncated"),
    ],
)
def test_sf32_rejects_malformed(data: bytes, match: str) -> None:
    with pytest.raises(IntegrityError, match=match):
        read_sf32(data)


@pytest.mark.parametrize("data", [SF32_VECTOR, SF32_MULTI])
def test_sf32_every_truncation_is_an_integrity_error(data: bytes) -> None:
    for n in range(len(data)):
        with pytest.raises(IntegrityError):
            decode_sf32(data[:n])


@pytest.mark.parametrize("data", [SF32_VECTOR, SF32_MULTI])
def test_sf32_single_byte_corruption_never_escapes(data: bytes) -> None:
    for i in range(len(data)):
        for b in (0x00, 0x01, 0x80, 0xFF):
            with contextlib.suppress(CheckpointError):
                decode_sf32(data[:i] + bytes([b]) + data[i + 1 :])


# ---------------------------------------------------------------------------------------------
# JSON state
# ---------------------------------------------------------------------------------------------

BITS_JSON = (
    '{"format":"torchlean_state_bits_v1","state":['
    '{"shape":[2,2],"values":[4607182418800017408,13835058055282163712,'
    "9218868437227405312,9223372036854775808]},"
    '{"shape":[],"values":[9221120237041090560]},'
    '{"shape":[3,0],"values":[]}]}'
)
FLOAT32_JSON = (
    '{"format":"torchlean_state_float32_bits_v1","state":['
    '{"shape":[3],"values":[1065353216,3223322624,2143289344]}]}'
)
BINARY_JSON = (
    '{"format":"torchlean_state_binary_5_6_15_ieee_v1","state":['
    '{"shape":[2,3],"values":[0,1,4095,2048,1984,2047]}]}'
)
NEG_BIAS_JSON = (
    '{"format":"torchlean_state_binary_4_3_-7_finite-max-nan_v1","state":['
    '{"shape":[2],"values":[255,0]}]}'
)
WIDE_JSON = (  # a 64-bit configured format keeps every word, 2^64 - 1 included
    '{"format":"torchlean_state_binary_11_52_1023_ieee_v1","state":['
    '{"shape":[2],"values":[18446744073709551615,9221120237041090561]}]}'
)
COMPLEX_JSON = (
    '{"format":"torchlean_state_complex_v1(torchlean_state_float32_bits_v1)","state":['
    '{"shape":[2],"values":[[1065353216,0],[3223322624,2143289344]]}]}'
)


@pytest.mark.parametrize(
    ("text", "dtype", "words"),
    [
        (
            BITS_JSON,
            np.uint64,
            [
                [[dbits(1.0), dbits(-2.0)], [dbits(math.inf), dbits(-0.0)]],
                0x7FF8000000000000,
                np.zeros((3, 0)).tolist(),
            ],
        ),
        (FLOAT32_JSON, np.uint32, [[0x3F800000, 0xC0200000, 0x7FC00000]]),
        (BINARY_JSON, np.uint16, [[[0, 1, 4095], [2048, 1984, 2047]]]),
        (NEG_BIAS_JSON, np.uint8, [[255, 0]]),
        (WIDE_JSON, np.uint64, [[2**64 - 1, 0x7FF8000000000001]]),
        (COMPLEX_JSON, np.uint32, [[[0x3F800000, 0], [0xC0200000, 0x7FC00000]]]),
    ],
)
def test_json_round_trip_is_bit_exact(text: str, dtype: type, words: list, tmp_path) -> None:
    state = decode_state_json(text)
    assert state.tag == json.loads(text)["format"]
    assert [t.dtype for t in state.tensors] == [np.dtype(dtype)] * len(words)
    assert [t.tolist() for t in state.tensors] == words
    assert encode_state_json(state) == text.encode()
    # bytes in, a path in, a pretty-printed file in: same words, canonical bytes out
    assert encode_state_json(read_state_json(text.encode())) == text.encode()
    path = tmp_path / "s.json"
    path.write_text(json.dumps(json.loads(text), indent=2))
    assert encode_state_json(read_state_json(path)) == text.encode()
    write_state_json(tmp_path / "out.json", state)
    assert (tmp_path / "out.json").read_bytes() == text.encode()


def test_complex_words_carry_a_pair_axis() -> None:
    (t,) = decode_state_json(COMPLEX_JSON).tensors
    assert t.shape == (2, 2)  # shape [2] plus the (re, im) axis


def test_read_state_json_wants_a_path_not_text() -> None:
    with pytest.raises(TypeError, match="decode_state_json"):
        read_state_json(BINARY_JSON)


def _tagged(tag: str, values: str, shape: str = "[1]") -> str:
    return f'{{"format":"{tag}","state":[{{"shape":{shape},"values":{values}}}]}}'


B64, F32, B12 = (
    "torchlean_state_bits_v1",
    "torchlean_state_float32_bits_v1",
    "torchlean_state_binary_5_6_15_ieee_v1",
)
CF32 = "torchlean_state_complex_v1(torchlean_state_float32_bits_v1)"


@pytest.mark.parametrize(
    ("text", "error", "match"),
    [
        # words out of range, negative, or not JSON natural numbers
        (_tagged(B64, "[18446744073709551616]"), FormatError, "64-bit word"),
        (_tagged(F32, "[4294967296]"), FormatError, "32-bit word"),
        (_tagged(B12, "[4096]"), FormatError, "12-bit word"),
        (_tagged(B12, "[-1]"), FormatError, "not a natural number"),
        (_tagged(B12, "[1.0]"), FormatError, "1.0 is not a natural number"),
        (_tagged(B12, "[1e3]"), FormatError, "not a natural number"),
        (_tagged(B12, "[true]"), FormatError, "not a natural number"),
        (_tagged(B12, '["5"]'), FormatError, "not a natural number"),
        (_tagged(B12, "[null]"), FormatError, "not a natural number"),
        (_tagged(B12, "[NaN]"), FormatError, "not a natural number"),
        (_tagged(B12, "[" + "9" * 5000 + "]"), FormatError, "number"),
        (_tagged(CF32, "[[1,4294967296]]"), FormatError, "value 0 im"),
        # non-canonical NaN words under the native tags
        (_tagged(B64, "[9221120237041090561]"), FormatError, "non-canonical NaN"),
        (_tagged(B64, "[18444492273895866368]"), FormatError, "non-canonical NaN"),
        (_tagged(B64, "[18446744073709551615]"), FormatError, "non-canonical NaN"),
        (_tagged(F32, "[2143289345]"), FormatError, "non-canonical NaN"),
        (_tagged(CF32, "[[0,2139095041]]"), FormatError, "value 0 im"),
        # unknown or non-canonical tags
        (_tagged("torchlean_state_bits_v2", "[0]"), FormatError, "unknown"),
        (_tagged("torchlean_state_binary_1_6_15_ieee_v1", "[0]"), FormatError, "exponent"),
        (_tagged("torchlean_state_binary_5_0_15_ieee_v1", "[0]"), FormatError, "fraction"),
        (_tagged("torchlean_state_binary_40_30_15_ieee_v1", "[0]"), FormatError, "64"),
        (_tagged("torchlean_state_binary_5_6_15_weird_v1", "[0]"), FormatError, "unknown"),
        (_tagged("torchlean_state_binary_05_6_15_ieee_v1", "[0]"), FormatError, "unknown"),
        (_tagged("torchlean_state_binary_5_6_+15_ieee_v1", "[0]"), FormatError, "unknown"),
        (_tagged("torchlean_state_binary_5_6_-0_ieee_v1", "[0]"), FormatError, "-0"),
        (_tagged("torchlean_state_binary_\uff15_6_15_ieee_v1", "[0]"), FormatError, "unknown"),
        (_tagged(f"torchlean_state_complex_v1({CF32})", "[[0,0]]"), FormatError, "nested"),
        (
            _tagged("torchlean_state_complex_v1(torchlean_state_bits_v1", "[[0,0]]"),
            FormatError,
            "unknown",
        ),
        (_tagged("torchlean_state_complex_v1(bogus)", "[[0,0]]"), FormatError, "bogus"),
        # structure
        (_tagged(B12, "[1,2]"), IntegrityError, "holds 1 scalars but values has 2"),
        (_tagged(B12, "[1,2]", "[3]"), IntegrityError, "holds 3 scalars"),
        (_tagged(B12, "[]", "[-1]"), IntegrityError, "dim 0"),
        (_tagged(B12, "[]", "[1.5]"), IntegrityError, "dim 0"),
        (_tagged(B12, "[]", "[true]"), IntegrityError, "dim 0"),
        (_tagged(B12, "[]", "2"), IntegrityError, "shape must be an array"),
        (_tagged(B12, "7"), IntegrityError, "values must be an array"),
        (_tagged(CF32, "[[1,2,3]]"), IntegrityError, r"\[re, im\] pair"),
        (_tagged(CF32, "[1]"), IntegrityError, r"\[re, im\] pair"),
        (_tagged(CF32, "[[1.5]]"), IntegrityError, r"pair, got \[1.5\]"),
        ('{"format":"torchlean_state_bits_v1"}', IntegrityError, "missing"),
        ('{"format":"torchlean_state_bits_v1","state":[],"x":1}', IntegrityError, "unexpected"),
        ('{"format":"torchlean_state_bits_v1","state":{}}', IntegrityError, "array"),
        ('{"format":7,"state":[]}', IntegrityError, "format"),
        ('{"format":"a","format":"b","state":[]}', IntegrityError, "duplicate key"),
        ('{"format":"torchlean_state_bits_v1","state":[[]]}', IntegrityError, "tensor 0"),
        ('{"format":"torchlean_state_bits_v1","state":[{"shape":[]}]}', IntegrityError, "values"),
        ("[]", IntegrityError, "object"),
        ('{"format":', IntegrityError, "invalid JSON"),
        ("", IntegrityError, "invalid JSON"),
        ("[" * 100000, IntegrityError, "JSON"),
    ],
)
def test_json_rejects_malformed(text: str, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        decode_state_json(text)


def test_json_rejects_non_utf8_and_huge_shapes_quickly() -> None:
    with pytest.raises(IntegrityError, match="UTF-8"):
        read_state_json(b'{"format":"\xff"}')
    start = time.perf_counter()
    with pytest.raises(IntegrityError, match="values has 0"):
        decode_state_json(_tagged(B64, "[]", f"[{2**60},{2**60}]"))
    assert time.perf_counter() - start < 1.0


def test_json_single_character_deletion_never_escapes() -> None:
    for text in (BITS_JSON, COMPLEX_JSON):
        for i in range(len(text)):
            with contextlib.suppress(CheckpointError):
                decode_state_json(text[:i] + text[i + 1 :])


def test_json_writer_validates() -> None:
    ok = np.array([1], dtype=np.uint16)
    with pytest.raises(FormatError, match="unknown"):
        encode_state_json(TLState("torchlean_state_nope_v1", [ok]))
    with pytest.raises(FormatError, match="unsigned-integer"):
        encode_state_json(TLState(B12, [np.array([1.0])]))
    with pytest.raises(FormatError, match="does not fit 12 bits"):
        encode_state_json(TLState(B12, [np.array([1, 4096], dtype=np.uint16)]))
    with pytest.raises(FormatError, match="non-canonical NaN"):
        encode_state_json(TLState(B64, [np.array([0x7FF0000000000001], dtype=np.uint64)]))
    with pytest.raises(FormatError, match="non-canonical NaN"):
        encode_state_json(TLState(CF32, [np.array([[0, 0x7FC00001]], dtype=np.uint32)]))
    with pytest.raises(FormatError, match="trailing axis of length 2"):
        encode_state_json(TLState(CF32, [np.array([1, 2, 3], dtype=np.uint32)]))
    # a wider unsigned dtype is fine as long as the words fit
    wide = TLState(B12, [np.array([[0, 1, 4095], [2048, 1984, 2047]], dtype=np.uint64)])
    assert encode_state_json(wide) == BINARY_JSON.encode()


def test_tags_parse_and_print_canonically() -> None:
    cases = {
        "torchlean_state_bits_v1": ("binary64", 64, np.uint64),
        "torchlean_state_float32_bits_v1": ("float32", 32, np.uint32),
        "torchlean_state_binary_5_6_15_ieee_v1": ("binary", 12, np.uint16),
        "torchlean_state_binary_2_1_0_finite_v1": ("binary", 4, np.uint8),
        "torchlean_state_binary_8_7_127_finite-unsigned-zero_v1": ("binary", 16, np.uint16),
        "torchlean_state_binary_8_23_-3_finite-max-nan_v1": ("binary", 32, np.uint32),
        "torchlean_state_binary_11_52_1023_ieee_v1": ("binary", 64, np.uint64),
        complex_tag("torchlean_state_binary_5_2_15_ieee_v1"): ("complex", 8, np.uint8),
    }
    for tag, (kind, width, dtype) in cases.items():
        parsed = parse_tag(tag)
        assert (parsed.kind, parsed.width, parsed.word_dtype, parsed.tag) == (
            kind,
            width,
            np.dtype(dtype),
            tag,
        )
    b = parse_tag("torchlean_state_binary_8_23_-3_finite-max-nan_v1")
    assert (b.exponent_bits, b.fraction_bits, b.bias, b.encoding) == (8, 23, -3, "finite-max-nan")
    assert binary_tag(5, 6, 15, "ieee") == "torchlean_state_binary_5_6_15_ieee_v1"
    assert complex_tag(B64) == "torchlean_state_complex_v1(torchlean_state_bits_v1)"
    assert parse_tag(complex_tag(B64)).component == parse_tag(B64)
    for args in ((1, 6, 15, "ieee"), (5, 0, 15, "ieee"), (32, 32, 0, "ieee"), (5, 6, 15, "x")):
        with pytest.raises(FormatError):
            binary_tag(*args)
    with pytest.raises(FormatError, match="complex"):
        complex_tag(CF32)


# ---------------------------------------------------------------------------------------------
# TLADAMF
# ---------------------------------------------------------------------------------------------

HYPER = (dbits(0.9), dbits(0.999), dbits(1e-8), dbits(0.0))

ADAM_V2 = (
    b"TLADAMF"
    + u64(2)  # version
    + u64(0)  # kind: adam
    + u64(*HYPER)  # beta1, beta2, eps, weight_decay as binary64 words
    + u64(2)  # parameter count
    + u64(2, 2, 3, 6, 1)  # param 0: rank 2, dims [2, 3], count 6, requiresGrad 1
    + u64(1, 4, 4, 0)  # param 1: rank 1, dims [4], count 4, frozen
    + u64(1)  # entry count
    + u64(0, 7, 6)  # entry: id 0, step 7, count 6
    + f32(0, 1, 2, 3, 4, 5)  # m
    + f32(*[0.25] * 6)  # v
)

ADAM_V3 = (
    b"TLADAMF"
    + u64(3, 0, *HYPER)
    + u64(3)  # three params; param 2 shares param 0's storage
    + u64(1, 2, 2, 1)  # param 0: [2], trainable
    + u64(1, 3, 3, 0)  # param 1: [3], frozen
    + u64(1, 2, 2, 1)  # param 2: [2], trainable
    + u64(1, 0, 1)  # alias tags, after the whole schema: 0 -> self, 1 frozen, 2 -> param 0
    + u64(1)
    + u64(0, 3, 2)
    + f32(1.5, -1.5)
    + f32(2.0, 0.0)
)

ADAMW_HYPER = (dbits(0.9), dbits(0.95), dbits(1e-6), dbits(0.01))
ADAM_V4 = (
    b"TLADAMF"
    + u64(4, 1, *ADAMW_HYPER)  # version 4, adamW
    + u64(12345)  # random counter
    + u64(2)
    + u64(0, 1, 1)  # param 0: rank 0 (scalar), count 1, trainable
    + u64(2, 2, 2, 4, 1)  # param 1: [2, 2], trainable
    + u64(1, 2)  # alias tags: both own their history
    + u64(2)
    + u64(1, 2, 4)  # entries in file order: param 1 first
    + u32(0x7FC00001, 0x80000000, 0x00000001, 0xFF800000)  # NaN payload, -0, subnormal, -inf
    + f32(1, 2, 3, 4)
    + u64(0, 9, 1)
    + f32(0.125)
    + f32(0.5)
)


def test_adam_v2_fields() -> None:
    f = read_adam(ADAM_V2)
    assert (f.version, f.kind, f.random_counter) == (2, "adam", None)
    assert (f.beta1, f.beta2, f.eps, f.weight_decay) == (0.9, 0.999, 1e-8, 0.0)
    assert f.hyper_bits == HYPER
    assert [(p.shape, p.requires_grad, p.alias) for p in f.params] == [
        ((2, 3), True, None),
        ((4,), False, None),
    ]
    (e,) = f.entries
    assert (e.id, e.step) == (0, 7)
    assert e.m.dtype == e.v.dtype == np.float32
    assert e.m.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert e.v.tolist() == [[0.25] * 3] * 2
    assert encode_adam(f) == ADAM_V2


def test_adam_v3_fields() -> None:
    f = read_adam(ADAM_V3)
    assert f.version == 3
    assert [(p.shape, p.requires_grad, p.alias) for p in f.params] == [
        ((2,), True, 1),
        ((3,), False, 0),
        ((2,), True, 1),
    ]
    assert [f.representative(i) for i in range(3)] == [0, None, 0]
    (e,) = f.entries
    assert (e.id, e.step, e.m.tolist(), e.v.tolist()) == (0, 3, [1.5, -1.5], [2.0, 0.0])
    assert encode_adam(f) == ADAM_V3


def test_adam_v4_fields_and_bits() -> None:
    f = read_adam(ADAM_V4)
    assert (f.version, f.kind, f.random_counter) == (4, "adamw", 12345)
    assert (f.beta2, f.weight_decay, f.hyper_bits) == (0.95, 0.01, ADAMW_HYPER)
    assert [(p.shape, p.alias) for p in f.params] == [((), 1), ((2, 2), 2)]
    e1, e0 = f.entries
    assert (e1.id, e1.step, e0.id, e0.step) == (1, 2, 0, 9)
    assert e1.m.shape == (2, 2)
    assert e1.m.view(np.uint32).ravel().tolist() == [0x7FC00001, 0x80000000, 1, 0xFF800000]
    assert e0.m.shape == () and float(e0.m) == 0.125 and float(e0.v) == 0.5
    assert encode_adam(f) == ADAM_V4  # entry order and NaN payload kept


def test_adam_doc_example() -> None:
    """The 135-byte version 2 example of docs/FORMAT.md, section 4."""
    data = bytes.fromhex(
        "544c4144414d46" + "0200000000000000" + "0000000000000000"
        + "cdccccccccccec3f" + "2b8716d9cef7ef3f" + "3a8c30e28e79453e" + "0000000000000000"
        + "0100000000000000" * 6 + "0000000000000000" + "0100000000000000" * 2
        + "0000003f" + "0000803e"
    )  # fmt: skip
    assert len(data) == 135
    f = read_adam(data)
    assert (f.beta1, f.beta2, f.eps, f.weight_decay) == (0.9, 0.999, 1e-8, 0.0)
    assert [(p.shape, p.requires_grad) for p in f.params] == [((1,), True)]
    (e,) = f.entries
    assert (e.id, e.step, e.m.tolist(), e.v.tolist()) == (0, 1, [0.5], [0.25])
    assert encode_adam(f) == data


def test_adam_built_from_dataclasses(tmp_path) -> None:
    f = TLAdamFile(
        version=2,
        kind="adam",
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        hyper_bits=HYPER,
        random_counter=None,
        params=[TLAdamParam((2, 3), True), TLAdamParam((4,), False)],
        entries=[
            TLAdamEntry(
                0,
                7,
                np.arange(6, dtype=np.float32).reshape(2, 3),
                np.full((2, 3), 0.25, np.float32),
            )
        ],
    )
    write_adam(tmp_path / "opt.bin", f)
    assert (tmp_path / "opt.bin").read_bytes() == ADAM_V2
    assert read_adam(tmp_path / "opt.bin").hyper_bits == HYPER


def _adam(
    version: int = 2,
    kind: int = 0,
    params: tuple = (((2,), 1),),
    aliases: tuple | None = None,
    entries: tuple = ((0, 1, 2),),
    trailer: bytes = b"",
) -> bytes:
    """A TLADAMF file from parts; every entry gets zero moments of its stated count."""
    out = b"TLADAMF" + u64(version, kind, *HYPER)
    if version >= 4:
        out += u64(5)
    out += u64(len(params))
    for shape, flag in params:
        out += u64(len(shape), *shape, math.prod(shape), flag)
    if aliases is not None:
        out += u64(*aliases)
    out += u64(len(entries))
    for pid, step, count in entries:
        out += u64(pid, step, count) + f32(*[0.0] * min(count, 16)) * 2
    return out + trailer


def test_adam_part_builder_matches_a_valid_file() -> None:
    assert read_adam(_adam()).entries[0].m.tolist() == [0.0, 0.0]
    two = _adam(params=(((2,), 1), ((2,), 1)), entries=((1, 1, 2), (0, 4, 2)))
    assert [e.id for e in read_adam(two).entries] == [1, 0]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"TLADAMX" + ADAM_V2[7:], "wrong magic"),
        (SF32_VECTOR, "wrong magic"),
        (_adam(version=1), "unsupported version 1"),
        (_adam(version=5), "unsupported version 5"),
        (_adam(kind=2), "optimizer kind 2"),
        (_adam(params=(((2,), 2),)), "requiresGrad 2"),
        (ADAM_V2 + b"\x00", "trailing"),
        (_adam(entries=((0, 0, 2),)), "t = 0"),
        (_adam(entries=((5, 1, 2),)), "id 5 .* out of range"),
        (_adam(entries=((1, 1, 2),)), "id 1 .* out of range"),
        (_adam(entries=((0, 1, 3),)), "element count 3"),
        (_adam(entries=()), "entry count 0"),
        (_adam(entries=((0, 1, 2), (0, 1, 2))), "entry count 2"),
        (_adam(params=(((2,), 1), ((2,), 1)), entries=((0, 1, 2), (0, 1, 2))), "repeats"),
        (_adam(params=(((2,), 1), ((2,), 0)), entries=((1, 1, 2),)), "owns no optimizer"),
        (
            b"TLADAMF" + u64(2, 0, *HYPER, 1) + u64(1, 2, 3, 1) + u64(0),
            "element count 3 .* dims \\[2\\]",
        ),
        # alias maps TorchLean would not accept
        (_adam(3, params=(((2,), 1),), aliases=(0,)), "requires grad but has alias tag 0"),
        (_adam(3, params=(((2,), 0),), aliases=(1,), entries=()), "frozen"),
        (_adam(3, params=(((2,), 1), ((2,), 1)), aliases=(2, 2)), "does not precede"),
        (_adam(3, params=(((2,), 1), ((3,), 1)), aliases=(1, 1)), "differs from"),
        (_adam(3, params=(((2,), 0), ((2,), 1)), aliases=(0, 1)), "frozen"),
        (
            _adam(3, params=(((2,), 1), ((2,), 1), ((2,), 1)), aliases=(1, 1, 2)),
            "itself an alias",
        ),
        (_adam(3, params=(((2,), 1), ((2,), 1)), aliases=(1, 1), entries=((1, 1, 2),)), "owns"),
    ],
)
def test_adam_rejects_malformed(data: bytes, match: str) -> None:
    with pytest.raises(IntegrityError, match=match):
        read_adam(data)


@pytest.mark.parametrize("data", [ADAM_V2, ADAM_V3, ADAM_V4])
def test_adam_every_truncation_is_an_integrity_error(data: bytes) -> None:
    for n in range(len(data)):
        with pytest.raises(IntegrityError):
            decode_adam(data[:n])


@pytest.mark.parametrize("data", [ADAM_V3, ADAM_V4])
def test_adam_single_byte_corruption_never_escapes(data: bytes) -> None:
    for i in range(len(data)):
        for b in (0x00, 0x01, 0x02, 0x80, 0xFF):
            with contextlib.suppress(CheckpointError):
                decode_adam(data[:i] + bytes([b]) + data[i + 1 :])


HUGE = 2**60


@pytest.mark.parametrize(
    ("reader", "data"),
    [
        (decode_sf32, b"TLSF32B" + u64(1, HUGE)),
        (decode_sf32, b"TLSF32B" + u64(1, 1, HUGE)),
        (decode_sf32, b"TLSF32B" + u64(1, 1, 1, HUGE, HUGE)),
        (decode_sf32, b"TLSF32B" + u64(1, 1, 2, 2**31, 2**31, 2**62)),
        (decode_sf32, b"TLSF32B" + u64(1, 1, 2, 0, 2**64 - 1, 0)),  # no room in numpy
        (decode_adam, b"TLADAMF" + u64(2, 0, *HYPER, HUGE)),
        (decode_adam, b"TLADAMF" + u64(2, 0, *HYPER, 1, HUGE)),
        (decode_adam, _adam(entries=((0, 1, 2),))[:-48] + u64(HUGE)),
        (decode_adam, b"TLADAMF" + u64(2, 0, *HYPER, 1, 1, HUGE, HUGE, 1, 1, 0, 1, HUGE)),
    ],
)
def test_huge_claimed_sizes_fail_fast(reader, data: bytes) -> None:
    start = time.perf_counter()
    with pytest.raises(IntegrityError):
        reader(data)
    assert time.perf_counter() - start < 1.0


def test_adam_writer_validates() -> None:
    def fresh(data: bytes = ADAM_V4) -> TLAdamFile:
        return decode_adam(data)

    cases = []
    f = fresh()
    f.random_counter = None
    cases.append((f, "random_counter"))
    f = fresh(ADAM_V2)
    f.random_counter = 3
    cases.append((f, "no random counter"))
    f = fresh()
    f.version = 2
    f.random_counter = None
    cases.append((f, "alias None"))
    f = fresh(ADAM_V3)
    f.params[0].alias = None
    cases.append((f, "needs an alias tag"))
    f = fresh()
    f.version = 5
    cases.append((f, "version 5"))
    f = fresh()
    f.kind = "sgd"
    cases.append((f, "kind"))
    f = fresh()
    f.beta1 = 0.8
    cases.append((f, "beta1 = 0.8 disagrees"))
    f = fresh()
    f.hyper_bits = (1, 2, 3)  # type: ignore[assignment]
    cases.append((f, "four"))
    f = fresh()
    f.entries[0].m = f.entries[0].m.ravel()
    cases.append((f, "m has shape"))
    f = fresh()
    f.entries[0].v = f.entries[0].v.astype(np.float64)
    cases.append((f, "float32"))
    f = fresh()
    f.entries[0].step = 0
    cases.append((f, "step"))
    f = fresh()
    f.entries.pop()
    cases.append((f, "entries must cover"))
    f = fresh()
    f.params[0].requires_grad = False
    cases.append((f, "frozen"))
    f = fresh()
    f.random_counter = 2**64
    cases.append((f, "64-bit"))
    for bad, match in cases:
        with pytest.raises(FormatError, match=match):
            encode_adam(bad)
    nan_bits = fresh()
    nan_bits.hyper_bits = (0x7FF8000000000001, *ADAMW_HYPER[1:])
    nan_bits.beta1 = math.nan
    assert decode_adam(encode_adam(nan_bits)).hyper_bits[0] == 0x7FF8000000000001


# ---------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------

shapes = st.lists(st.integers(0, 4), max_size=3).map(tuple)


@st.composite
def float32_tensors(draw) -> np.ndarray:
    shape = draw(shapes)
    raw = draw(st.binary(min_size=4 * math.prod(shape), max_size=4 * math.prod(shape)))
    return np.frombuffer(raw, dtype="<f4").reshape(shape)


@settings(max_examples=60, deadline=None)
@given(st.lists(float32_tensors(), max_size=4))
def test_sf32_round_trip_property(tensors: list[np.ndarray]) -> None:
    data = encode_sf32(tensors)
    back = decode_sf32(data)
    assert [t.shape for t in back] == [t.shape for t in tensors]
    assert all(b.dtype == np.float32 for b in back)
    assert [b.tobytes() for b in back] == [t.tobytes() for t in tensors]
    assert encode_sf32(back) == data


@st.composite
def binary_states(draw) -> TLState:
    e = draw(st.integers(2, 62))
    f = draw(st.integers(1, 63 - e))
    tag = binary_tag(
        e, f, draw(st.integers(-(10**6), 10**6)), draw(st.sampled_from(STATE_ENCODINGS))
    )
    if draw(st.booleans()):
        tag = complex_tag(tag)
    parsed = parse_tag(tag)
    tensors = []
    for shape in draw(st.lists(shapes, max_size=3)):
        full = shape + ((2,) if parsed.kind == "complex" else ())
        n = math.prod(full)
        words = draw(st.lists(st.integers(0, 2**parsed.width - 1), min_size=n, max_size=n))
        tensors.append(np.array(words, dtype=np.uint64).astype(parsed.word_dtype).reshape(full))
    return TLState(tag, tensors)


@settings(max_examples=60, deadline=None)
@given(binary_states())
def test_json_round_trip_property(state: TLState) -> None:
    data = encode_state_json(state)
    back = decode_state_json(data)
    assert back.tag == state.tag == parse_tag(state.tag).tag
    assert [(t.dtype, t.shape) for t in back.tensors] == [(t.dtype, t.shape) for t in state.tensors]
    assert [t.tolist() for t in back.tensors] == [t.tolist() for t in state.tensors]
    assert encode_state_json(back) == data
