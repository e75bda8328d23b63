"""Tests for model/quant_io.py: safetensors I/O, FP8/FP4 (de)quantisation, official checkpoints."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from model import quant_io as q  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "golden"  # <repo>/../shared/golden

E4M3 = ml_dtypes.float8_e4m3fn
E5M2 = ml_dtypes.float8_e5m2
E8M0 = ml_dtypes.float8_e8m0fnu
BF16 = ml_dtypes.bfloat16


def e8m0(*bytes_):
    return np.array(bytes_, np.uint8).view(E8M0)


def raw_safetensors(path, header: dict, data: bytes, header_len=None):
    hb = json.dumps(header).encode()
    n = len(hb) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + hb + data)
    return path


# ------------------------------------------------------------------------------- scales / FP4


def test_e8m0_known_values():
    s = q.e8m0_to_float32(e8m0(127, 130, 126, 0, 254, 255))
    assert s.dtype == np.float32
    assert s[0] == 1.0 and s[1] == 8.0 and s[2] == 0.5
    assert s[3] == np.float32(2.0 ** -127) and s[4] == np.float32(2.0 ** 127)
    assert np.isnan(s[5])
    # uint8 exponent bytes mean the same; float scales are plain multipliers
    np.testing.assert_array_equal(q.e8m0_to_float32(np.array([127, 130], np.uint8)), [1.0, 8.0])
    np.testing.assert_array_equal(q.e8m0_to_float32(np.array([0.25, 3.0], np.float32)), [0.25, 3.0])
    # agrees with ml_dtypes' own conversion
    b = np.arange(255, dtype=np.uint8)
    np.testing.assert_array_equal(q.e8m0_to_float32(b.view(E8M0)), b.view(E8M0).astype(np.float32))
    assert q.float32_to_e8m0(np.array([0, 3, -127])).view(np.uint8).tolist() == [127, 130, 0]


def test_e2m1_table():
    assert q.E2M1_VALUES.tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]
    assert np.signbit(q.E2M1_VALUES[8])


def test_unpack_fp4_low_nibble_first():
    np.testing.assert_array_equal(q.unpack_fp4(np.array([[0x21]], np.uint8)), [[1, 2]])
    # int8 storage with the sign bit set: 0xF8 = -8 -> low nibble 8, high nibble 15
    np.testing.assert_array_equal(q.unpack_fp4(np.array([[-8, 0x7A]], np.int8)),
                                  [[8, 15, 10, 7]])
    codes = np.arange(16, dtype=np.uint8).reshape(2, 8)
    packed = q.pack_fp4(codes)
    assert packed.dtype == np.int8 and packed.shape == (2, 4)
    assert packed.view(np.uint8)[0, 0] == 0x10 and packed.view(np.uint8)[1, 3] == 0xFE
    np.testing.assert_array_equal(q.unpack_fp4(packed), codes)


def test_dequant_fp4_known_values():
    packed = np.full((2, 16), 0x21, np.uint8).view(np.int8)  # 32 logical columns: 0.5, 1.0, ...
    scale = e8m0(127, 130)[:, None]                           # row 0 x1, row 1 x8
    w = q.dequant_fp4(packed, scale)
    assert w.dtype == np.float32 and w.shape == (2, 32)
    np.testing.assert_array_equal(w[0, :4], [0.5, 1.0, 0.5, 1.0])
    np.testing.assert_array_equal(w[1, :4], [4.0, 8.0, 4.0, 8.0])
    # two scale blocks per row; uint8 exponent bytes and float32 multipliers accepted
    packed = np.full((1, 32), 0xF7, np.uint8)                 # codes [7, 15] -> [6, -6]
    for sc in (e8m0(126, 128), np.array([[126, 128]], np.uint8), np.array([[0.5, 2.0]], np.float32)):
        w = q.dequant_fp4(packed, sc.reshape(1, 2))
        np.testing.assert_array_equal(w[0, :2], [3.0, -3.0])
        np.testing.assert_array_equal(w[0, 32:34], [12.0, -12.0])
    with pytest.raises(ValueError, match="my.w1"):
        q.dequant_fp4(packed, e8m0(127, 127, 127).reshape(1, 3), name="my.w1")


def test_fp4_rounding_ties_to_even_code():
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, 7.0, 0.26, 2.9, -5.1, -0.0, 6.0],
                 np.float32)
    assert q.fp4_codes_from_float(x).tolist() == [0, 2, 2, 4, 4, 6, 6, 8, 7, 1, 5, 15, 8, 7]
    # through quantize_fp4 with a block whose amax is exactly 6 (scale 1)
    w = np.zeros((1, 32), np.float32)
    w[0, :14] = x
    w[0, 8] = 6.0  # keep amax = 6 so the scale is 2^0
    packed, s = q.quantize_fp4(w)
    assert s.view(np.uint8).tolist() == [[127]]
    np.testing.assert_array_equal(q.dequant_fp4(packed, s)[0, :8], [0, 1, 1, 2, 2, 4, 4, -0.0])


def test_fp4_round_trip_exact_for_representable_values():
    rng = np.random.default_rng(0)
    out, inn = 6, 96
    codes = rng.integers(0, 16, size=(out, inn)).astype(np.uint8)
    codes[:, ::32] = rng.choice([7, 15], size=(out, inn // 32))  # |6| in every block
    exps = rng.integers(-20, 10, size=(out, inn // 32))
    w = q.E2M1_VALUES[codes] * np.repeat(np.ldexp(np.float32(1), exps), 32, axis=1).astype(np.float32)
    packed, s = q.quantize_fp4(w)
    assert packed.dtype == np.int8 and packed.shape == (out, inn // 2)
    assert s.dtype == E8M0 and s.shape == (out, inn // 32)
    np.testing.assert_array_equal(s.view(np.uint8).astype(int) - 127, exps)
    np.testing.assert_array_equal(q.dequant_fp4(packed, s), w)
    # codes identical except that -0 may come back as -0 (code 8) — equal as codes here
    np.testing.assert_array_equal(q.unpack_fp4(packed), codes)


def test_fp4_quantize_generic_error_bound():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    packed, s = q.quantize_fp4(w)
    deq = q.dequant_fp4(packed, s)
    sc = q.e8m0_to_float32(s)
    amax = np.abs(w).reshape(4, 2, 32).max(-1)
    assert np.all(amax / sc <= 6) and np.all(amax / sc > 3)  # minimal power of two
    assert np.all(np.abs(deq - w) <= np.repeat(sc, 32, 1) * 1.0 + 1e-7)  # half max spacing (2)
    # all-zero input: floor amax 6*2^-126 -> exponent -126
    p0, s0 = q.quantize_fp4(np.zeros((1, 32), np.float32))
    assert s0.view(np.uint8).tolist() == [[1]] and np.all(q.dequant_fp4(p0, s0) == 0)


# ------------------------------------------------------------------------------- FP8 blocks


def test_dequant_fp8_blocks_ragged_edges():
    rng = np.random.default_rng(2)
    out, inn, B = 5, 7, 2
    codes = rng.standard_normal((out, inn)).astype(E4M3)
    sb = rng.integers(120, 135, size=(3, 4)).astype(np.uint8)
    w = q.dequant_fp8_blocks(codes, sb.view(E8M0), B)
    assert w.dtype == np.float32 and w.shape == (out, inn)
    for i in range(out):
        for j in range(inn):
            assert w[i, j] == np.float32(codes[i, j]) * 2.0 ** (int(sb[i // B, j // B]) - 127)
    # same with uint8 exponent bytes, float32 multipliers, and an inferred block
    np.testing.assert_array_equal(q.dequant_fp8_blocks(codes, sb, B), w)
    np.testing.assert_array_equal(q.dequant_fp8_blocks(codes, sb.view(E8M0).astype(np.float32), B), w)
    np.testing.assert_array_equal(q.dequant_fp8_blocks(codes, sb.view(E8M0)), w)
    with pytest.raises(ValueError, match="layers.9.attn.wkv.weight"):
        q.dequant_fp8_blocks(codes, sb[:2], B, name="layers.9.attn.wkv.weight")
    with pytest.raises(ValueError, match="x.weight"):
        q.dequant_fp8_blocks(codes, sb, 4, name="x.weight")


def test_dequant_fp8_known_values():
    codes = np.array([[1.0, -2.0, 448.0], [0.5, 0.0, -448.0]], np.float32).astype(E4M3)
    w = q.dequant_fp8_blocks(codes, e8m0(130, 126).reshape(1, 2), 2)
    np.testing.assert_array_equal(w, [[8.0, -16.0, 224.0], [4.0, 0.0, -224.0]])


def test_infer_fp8_block():
    assert q.infer_fp8_block((128, 128), (1, 1)) == 128
    assert q.infer_fp8_block((96, 128), (1, 1)) == 128
    assert q.infer_fp8_block((128, 192), (1, 2)) == 128
    assert q.infer_fp8_block((384, 128), (3, 1)) == 128
    assert q.infer_fp8_block((64, 128), (2, 4)) == 32
    assert q.infer_fp8_block((1024, 4096), (8, 32)) == 128
    with pytest.raises(ValueError, match="foo"):
        q.infer_fp8_block((128, 192), (1, 3), name="foo")


def test_fp8_round_trip_exact_for_representable_values():
    rng = np.random.default_rng(3)
    out, inn, B = 70, 100, 32
    go, gi = math.ceil(out / B), math.ceil(inn / B)
    codes = rng.standard_normal((out, inn)).astype(np.float32) * 30
    codes = codes.astype(E4M3).astype(np.float32)
    exps = rng.integers(-30, 20, size=(go, gi))
    for bi in range(go):
        for bj in range(gi):
            codes[bi * B, bj * B] = rng.choice([-448.0, 320.0, 256.0])  # amax in [256, 448]
    w = codes * np.repeat(np.repeat(np.ldexp(np.float32(1), exps), B, 0), B, 1)[:out, :inn]
    w = w.astype(np.float32)
    e4, s = q.quantize_fp8_blocks(w, B)
    assert e4.dtype == E4M3 and e4.shape == (out, inn) and s.dtype == E8M0 and s.shape == (go, gi)
    np.testing.assert_array_equal(s.view(np.uint8).astype(int) - 127, exps)
    np.testing.assert_array_equal(q.dequant_fp8_blocks(e4, s, B), w)
    np.testing.assert_array_equal(q.dequant_fp8_blocks(e4, s), w)  # inferred B = 32


def test_fp8_quantize_generic():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((40, 50)).astype(np.float32) * 0.01
    e4, s = q.quantize_fp8_blocks(w, 16)
    deq = q.dequant_fp8_blocks(e4, s, 16)
    assert np.all(np.isfinite(deq))
    np.testing.assert_allclose(deq, w, rtol=2 ** -4, atol=1e-30)
    assert np.abs(e4.astype(np.float32)).max() <= 448
    e0, s0 = q.quantize_fp8_blocks(np.zeros((3, 3), np.float32), 2)
    assert np.all(q.dequant_fp8_blocks(e0, s0, 2) == 0)


def test_fp8_rows():
    codes = np.array([[1.0, 2.0] * 32, [-1.0, 0.5] * 32], np.float32).astype(E4M3)  # [2, 64]
    s = e8m0(127, 128, 125, 131).reshape(2, 2)
    w = q.dequant_fp8_rows(codes, s)
    np.testing.assert_array_equal(w[0, :2], [1.0, 2.0])
    np.testing.assert_array_equal(w[0, 32:34], [2.0, 4.0])
    np.testing.assert_array_equal(w[1, :2], [-0.25, 0.125])
    np.testing.assert_array_equal(w[1, 62:], [-16.0, 8.0])
    with pytest.raises(ValueError, match="engram"):
        q.dequant_fp8_rows(codes, s[:, :1], name="layers.1.engram.embed.weight")
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((5, 64)) * 40).astype(E4M3).astype(np.float32)
    x[:, 0] = 448.0
    x[:, 32] = -288.0
    e4, sr = q.quantize_fp8_rows(x)
    assert sr.shape == (5, 2)
    np.testing.assert_array_equal(q.dequant_fp8_rows(e4, sr), x)


# ------------------------------------------------------------------------------- safetensors


ALL_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": BF16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U8": np.uint8, "BOOL": np.bool_, "F8_E4M3": E4M3, "F8_E5M2": E5M2, "F8_E8M0": E8M0,
}


def _sample(dt, shape, rng):
    if dt == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if dt == E8M0:
        return rng.integers(100, 150, size=shape).astype(np.uint8).view(E8M0)
    if np.dtype(dt).kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(max(info.min, -1000), min(info.max, 1000), size=shape).astype(dt)
    return (rng.standard_normal(shape) * 3).astype(dt)


def test_write_read_round_trip_every_dtype(tmp_path):
    rng = np.random.default_rng(6)
    tensors = {f"t.{st}": _sample(dt, (3, 5), rng) for st, dt in ALL_DTYPES.items()}
    tensors["scalar"] = np.array(2.5, np.float32)
    tensors["empty"] = np.zeros((0, 4), BF16)
    tensors["odd_bytes"] = np.arange(3, dtype=np.int8)  # makes the next tensor unaligned
    tensors["unaligned_f64"] = np.array([1.5, -2.25], np.float64)
    tensors["big_endian"] = np.array([1, 2, 3], ">i4")
    path = tmp_path / "all.safetensors"
    q.write_safetensors(path, tensors, metadata={"format": "pt", "note": "x"})
    back = q.read_safetensors(path)
    assert set(back) == set(tensors)
    for name, a in tensors.items():
        b = back[name]
        assert b.shape == a.shape, name
        if name == "big_endian":
            assert b.dtype == np.dtype("<i4")
            np.testing.assert_array_equal(b, a)
            continue
        assert b.dtype == a.dtype, name
        assert b.tobytes() == np.ascontiguousarray(a).tobytes(), name
    assert isinstance(back["t.F32"], np.ndarray) and not back["t.F32"].flags.writeable
    assert not back["t.F32"].flags.owndata  # a view into the memory map, not a copy
    assert q.read_safetensors_metadata(path) == {"format": "pt", "note": "x"}
    header, _, start = q.read_safetensors_header(path)
    assert header["t.F8_E8M0"]["dtype"] == "F8_E8M0" and start % 8 == 0
    assert set(q.read_safetensors(path, names=["t.I8"])) == {"t.I8"}


def test_cross_check_with_safetensors_library(tmp_path):
    st_np = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(7)
    np_dtypes = {k: v for k, v in ALL_DTYPES.items() if k not in ("BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0")}
    tensors = {f"t.{st}": _sample(dt, (4, 3), rng) for st, dt in np_dtypes.items()}
    ours = tmp_path / "ours.safetensors"
    theirs = tmp_path / "theirs.safetensors"
    q.write_safetensors(ours, tensors)
    st_np.save_file(tensors, str(theirs), metadata={"format": "np"})
    a = st_np.load_file(str(ours))
    b = q.read_safetensors(theirs)
    for name, t in tensors.items():
        assert a[name].dtype == t.dtype and np.array_equal(a[name], t)
        assert b[name].dtype == t.dtype and np.array_equal(b[name], t)
    assert q.read_safetensors_metadata(theirs) == {"format": "np"}
    # FP8 / BF16 / E8M0 written by us, read back by the torch loader of safetensors
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file as torch_load
    special = {"bf": _sample(BF16, (2, 3), rng), "e4": _sample(E4M3, (2, 3), rng),
               "e5": _sample(E5M2, (2, 3), rng), "e8": _sample(E8M0, (2, 3), rng)}
    path = tmp_path / "special.safetensors"
    q.write_safetensors(path, special)
    tt = torch_load(str(path))
    assert tt["bf"].dtype == torch.bfloat16 and tt["e4"].dtype == torch.float8_e4m3fn
    assert tt["e5"].dtype == torch.float8_e5m2 and tt["e8"].dtype == torch.float8_e8m0fnu
    for k, v in special.items():
        assert tt[k].view(torch.uint8 if v.itemsize == 1 else torch.int16).numpy().tobytes() == v.tobytes()


def test_reader_errors(tmp_path):
    good = tmp_path / "good.safetensors"
    q.write_safetensors(good, {"a": np.arange(6, dtype=np.float32), "b": np.ones(2, np.int64)})
    data = good.read_bytes()

    trunc = tmp_path / "trunc.safetensors"
    trunc.write_bytes(data[:-4])
    with pytest.raises(ValueError, match="trunc.safetensors"):
        q.read_safetensors(trunc)
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(b"\x01\x00")
    with pytest.raises(ValueError, match="too small"):
        q.read_safetensors(tiny)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError, match="header length"):
        q.read_safetensors(huge)
    notjson = tmp_path / "nj.safetensors"
    raw_safetensors(notjson, {}, b"").write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(ValueError, match="JSON"):
        q.read_safetensors(notjson)

    def entry(dtype="F32", shape=(2,), offs=(0, 8)):
        return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offs)}

    cases = {
        "beyond": ({"x": entry(offs=(0, 16))}, b"\0" * 8, "outside"),
        "sizemismatch": ({"x": entry(shape=(3,), offs=(0, 8))}, b"\0" * 8, "needs 12"),
        "reversed": ({"x": entry(offs=(8, 0))}, b"\0" * 8, "outside"),
        "negshape": ({"x": entry(shape=(-2,))}, b"\0" * 8, "invalid shape"),
        "overlap": ({"x": entry(offs=(0, 8)), "y": entry(offs=(4, 12))}, b"\0" * 12, "overlap"),
        "baddtype": ({"weird.tensor": entry(dtype="C64")}, b"\0" * 8, "unknown"),
        "malformed": ({"x": {"dtype": "F32"}}, b"", "malformed"),
    }
    for fname, (header, payload, msg) in cases.items():
        p = raw_safetensors(tmp_path / f"{fname}.safetensors", header, payload)
        with pytest.raises(ValueError, match=msg) as ei:
            q.read_safetensors(p)
        assert fname in str(ei.value)
        if fname == "baddtype":
            assert "weird.tensor" in str(ei.value) and "C64" in str(ei.value)
    # zero-length tensors and a header-only file are fine
    p = raw_safetensors(tmp_path / "empty.safetensors", {"z": entry(shape=(0, 3), offs=(0, 0))}, b"")
    assert q.read_safetensors(p)["z"].shape == (0, 3)
    with pytest.raises(ValueError, match="not supported"):
        q.write_safetensors(tmp_path / "c.safetensors", {"c": np.zeros(2, np.complex64)})


def test_checkpoint_directory_helpers(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    q.write_safetensors(d / "model-00001-of-00002.safetensors", {"a": np.zeros(2, np.float32)})
    q.write_safetensors(d / "model-00002-of-00002.safetensors",
                        {"b": np.ones(3, np.int32), "c": np.ones(1, BF16)})
    # glob fallback
    files = q.list_checkpoint_files(d)
    assert [f.name for f in files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert q.list_checkpoint_files(files[0]) == [files[0]]
    # with an index
    wm = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
          "c": "model-00002-of-00002.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    assert [f.name for f in q.list_checkpoint_files(d)] == [f.name for f in files]
    it = q.iter_checkpoint_tensors(d)
    assert not isinstance(it, (list, dict))
    got = dict(it)
    assert set(got) == {"a", "b", "c"} and got["b"].tolist() == [1, 1, 1]
    # a tensor in the weight_map but absent from its shard
    wm["d"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(ValueError, match="'d'"):
        list(q.iter_checkpoint_tensors(d))
    # a missing shard is named
    wm["e"] = "model-00003-of-00003.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(ValueError, match="model-00003-of-00003.safetensors"):
        q.list_checkpoint_files(d)
    with pytest.raises(FileNotFoundError):
        q.list_checkpoint_files(tmp_path / "nope")
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(FileNotFoundError):
        q.list_checkpoint_files(tmp_path / "emptydir")


# ------------------------------------------------------------------------------- official names


def _official_sample(rng):
    wq_a = (rng.standard_normal((256, 192)) * 0.05).astype(np.float32)
    e4, s = q.quantize_fp8_blocks(wq_a, 128)
    w1 = rng.standard_normal((64, 128)).astype(np.float32)
    p4, s4 = q.quantize_fp4(w1)
    emb = rng.standard_normal((10, 64)).astype(np.float32)
    e4r, s4r = q.quantize_fp8_rows(emb)
    return {
        "layers.2.attn.wq_a.weight": e4, "layers.2.attn.wq_a.scale": s,
        "layers.0.ffn.experts.3.w1.weight": p4, "layers.0.ffn.experts.3.w1.scale": s4,
        "layers.1.engram.embed.weight": e4r, "layers.1.engram.embed.scale": s4r,
        "layers.0.attn_norm.weight": np.ones(192, BF16),
        "layers.0.hc_attn_scale": np.array([0.5, 1.0, 2.0], np.float32),
        "layers.0.ffn.gate.tid2eid": np.arange(12, dtype=np.int64).reshape(6, 2),
    }


def test_dequantize_official_synthetic(tmp_path):
    rng = np.random.default_rng(8)
    t = _official_sample(rng)
    path = tmp_path / "m.safetensors"
    q.write_safetensors(path, t)
    t = q.read_safetensors(path)
    d = q.dequantize_official(t)
    assert set(d) == {k for k in t if not k.endswith(".scale")}
    assert d["layers.2.attn.wq_a.weight"].shape == (256, 192)
    assert d["layers.0.ffn.experts.3.w1.weight"].shape == (64, 128)
    assert d["layers.1.engram.embed.weight"].shape == (10, 64)
    for k, v in d.items():
        if k.endswith("tid2eid"):
            assert v.dtype == np.int64
        else:
            assert v.dtype == np.float32 and np.all(np.isfinite(v))
    np.testing.assert_array_equal(
        d["layers.2.attn.wq_a.weight"],
        q.dequant_fp8_blocks(t["layers.2.attn.wq_a.weight"], t["layers.2.attn.wq_a.scale"], 128))
    np.testing.assert_array_equal(
        d["layers.0.ffn.experts.3.w1.weight"],
        q.dequant_fp4(t["layers.0.ffn.experts.3.w1.weight"], t["layers.0.ffn.experts.3.w1.scale"]))
    np.testing.assert_array_equal(
        d["layers.1.engram.embed.weight"],
        q.dequant_fp8_rows(t["layers.1.engram.embed.weight"], t["layers.1.engram.embed.scale"]))
    # an explicit FP8 block gives the same
    d2 = q.dequantize_official(t, fp8_block=128)
    np.testing.assert_array_equal(d2["layers.2.attn.wq_a.weight"], d["layers.2.attn.wq_a.weight"])
    # float32 scales (plain multipliers) also work
    t2 = dict(t)
    t2["layers.2.attn.wq_a.scale"] = q.e8m0_to_float32(t["layers.2.attn.wq_a.scale"])
    np.testing.assert_array_equal(q.dequantize_official(t2)["layers.2.attn.wq_a.weight"],
                                  d["layers.2.attn.wq_a.weight"])


def test_dequantize_official_errors():
    rng = np.random.default_rng(9)
    t = _official_sample(rng)
    for missing, msg in [("layers.2.attn.wq_a.scale", "layers.2.attn.wq_a.weight"),
                         ("layers.0.ffn.experts.3.w1.scale", "layers.0.ffn.experts.3.w1.weight"),
                         ("layers.2.attn.wq_a.weight", "layers.2.attn.wq_a.scale"),
                         ("layers.0.ffn.experts.3.w1.weight", "layers.0.ffn.experts.3.w1.scale")]:
        bad = {k: v for k, v in t.items() if k != missing}
        with pytest.raises(ValueError, match=msg.replace(".", r"\.")):
            q.dequantize_official(bad)
    bad = dict(t)
    bad["layers.2.attn.wq_a.scale"] = e8m0(*([127] * 6)).reshape(2, 3)
    with pytest.raises(ValueError, match=r"layers\.2\.attn\.wq_a\.weight"):
        q.dequantize_official(bad)
    bad = dict(t)
    bad["layers.0.ffn.experts.3.w1.scale"] = e8m0(*([127] * 64 * 8)).reshape(64, 8)
    with pytest.raises(ValueError, match=r"experts\.3\.w1"):
        q.dequantize_official(bad)
    with pytest.raises(ValueError, match="fp8_block"):
        q.dequantize_official({k: t[k] for k in ("layers.2.attn.wq_a.weight", "layers.2.attn.wq_a.scale")},
                              fp8_block=32)
    bad = {"x.weight": np.ones((2, 2), BF16), "x.scale": e8m0(127).reshape(1, 1)}
    with pytest.raises(ValueError, match="x.weight"):
        q.dequantize_official(bad)


# ------------------------------------------------------------------------------- golden checkpoint


@pytest.mark.parametrize("variant", ["v4", "v41"])
def test_golden_checkpoint(variant):
    root = GOLDEN / variant
    if not (root / "model.safetensors").is_file():
        pytest.skip(f"golden data not available at {root}")
    index = json.loads((root / "tensor_index.json").read_text())
    raw = q.read_safetensors(root / "model.safetensors")
    assert set(raw) == set(index)
    np_name = {"float32": np.float32, "int64": np.int64, "int8": np.int8, "bfloat16": BF16,
               "float8_e4m3fn": E4M3, "float8_e8m0fnu": E8M0}
    for name, info in index.items():
        assert raw[name].dtype == np.dtype(np_name[info["dtype"]]), name
        assert list(raw[name].shape) == info["shape"], name

    # our reader vs safetensors.numpy (F32 / I64 / I8) and safetensors.torch (bf16 / fp8 / e8m0)
    from safetensors import safe_open
    with safe_open(str(root / "model.safetensors"), framework="numpy") as f:
        for name, info in index.items():
            if info["dtype"] in ("float32", "int64", "int8"):
                ref = f.get_tensor(name)
                assert ref.dtype == raw[name].dtype and np.array_equal(ref, raw[name]), name
    try:
        import torch
        from safetensors.torch import load_file as torch_load
    except ImportError:  # pragma: no cover
        torch = None
    if torch is not None:
        tt = torch_load(str(root / "model.safetensors"))
        for name, a in raw.items():
            t = tt[name]
            as_bytes = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
            assert as_bytes == a.tobytes(), name

    deq = q.dequantize_official(raw)
    assert not any(k.endswith(".scale") for k in deq)
    expected = {k for k, v in index.items() if "format" in v}
    assert set(deq) == expected
    assert all(k.endswith(".scale") for k in set(index) - expected)
    B = 128 if variant == "v4" else 32
    for name, info in index.items():
        if name not in deq:
            continue
        a = deq[name]
        fmt = info["format"]
        shape = list(info["shape"])
        if fmt == "FP4":
            shape[-1] *= 2
        assert list(a.shape) == shape, (name, a.shape, shape)
        if fmt == "I64":
            assert a.dtype == np.int64
        else:
            assert a.dtype == np.float32, name
            assert np.all(np.isfinite(a)), name
        if fmt == "FP8":
            sname = name[:-len(".weight")] + ".scale"
            assert list(raw[sname].shape) == [math.ceil(shape[0] / B), math.ceil(shape[1] / B)], name
            if torch is not None:  # independent dequant with torch
                w = tt[name].float()
                s = tt[sname].float().repeat_interleave(B, 0).repeat_interleave(B, 1)
                ref = (w * s[: shape[0], : shape[1]]).numpy()
                np.testing.assert_array_equal(a, ref, err_msg=name)
        elif fmt in ("BF16", "F32"):
            np.testing.assert_array_equal(a, raw[name].astype(np.float32))
    if variant == "v4":
        assert deq["layers.0.attn.wq_a.weight"].shape == (128, 128)
        assert deq["layers.0.ffn.experts.0.w1.weight"].shape == (128, 128)
        assert deq["layers.0.attn.wo_a.weight"].shape == (128, 192)
        assert deq["layers.0.ffn.gate.tid2eid"].dtype == np.int64
    else:
        assert deq["layers.1.engram.embed.weight"].shape == (384, 64)
    # FP4 tensors only take E2M1 values times powers of two; non-trivial content
    for name, info in index.items():
        if info.get("format") == "FP4":
            codes = q.unpack_fp4(raw[name])
            sc = q.e8m0_to_float32(raw[name[:-len(".weight")] + ".scale"])
            np.testing.assert_array_equal(deq[name], q.E2M1_VALUES[codes] * np.repeat(sc, 32, 1))
            assert len(np.unique(codes)) > 8
