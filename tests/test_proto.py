"""The wire contract: generated code in sync with features.proto; tensors round-trip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from vit22b.v1 import features_pb2 as pb
from vit22b.v1 import wire

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ("features_pb2.py", "features_pb2.pyi", "features_pb2_grpc.py")


def test_generated_code_matches_the_proto(tmp_path):
    """`make protos` regenerates exactly what is committed; edit the .proto, then regenerate."""
    pytest.importorskip("grpc_tools")
    out = tmp_path / "out"
    (out / "vit22b" / "v1").mkdir(parents=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT / 'protos'}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(ROOT / "protos" / "vit22b" / "v1" / "features.proto"),
        ],
        check=True,
        capture_output=True,
    )
    for name in GENERATED:
        fresh = (out / "vit22b" / "v1" / name).read_text()
        committed = (ROOT / "protos" / "vit22b" / "v1" / name).read_text()
        assert fresh == committed, f"{name} drifted from features.proto: run `make protos`"
    grpc_code = (ROOT / "protos" / "vit22b" / "v1" / "features_pb2_grpc.py").read_text()
    assert "from vit22b.v1 import features_pb2" in grpc_code


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "uint8"])
def test_tensors_round_trip_exactly(dtype):
    rng = np.random.default_rng(0)
    if dtype == "uint8":
        array = rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)
    else:
        array = rng.standard_normal((3, 4, 5)).astype(np.float32)
    tensor = wire.to_tensor(array, dtype)
    assert tensor.dtype == wire.DTYPES[dtype] and list(tensor.shape) == list(array.shape)
    back = wire.from_tensor(pb.Tensor.FromString(tensor.SerializeToString()))
    expected = array.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    assert back.dtype == expected.dtype
    np.testing.assert_array_equal(back, expected)
    assert back.flags.writeable


def test_tensor_bytes_are_little_endian_c_order():
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    tensor = wire.to_tensor(np.asfortranarray(array))
    assert tensor.data == array.astype("<f4").tobytes(order="C")


def test_malformed_tensors_are_refused():
    good = wire.to_tensor(np.zeros((2, 3), np.float32))
    short = pb.Tensor(dtype=good.dtype, shape=good.shape, data=good.data[:-1])
    with pytest.raises(wire.WireError, match="needs 24 bytes, got 23"):
        wire.from_tensor(short)
    with pytest.raises(wire.WireError, match="dtype 42 is unknown"):
        wire.from_tensor(pb.Tensor(dtype=42, shape=[1], data=b"\0"))
    with pytest.raises(wire.WireError, match="negative"):
        wire.from_tensor(pb.Tensor(dtype=pb.DTYPE_UINT8, shape=[-1], data=b""))
    with pytest.raises(wire.WireError, match="cannot travel"):
        wire.to_tensor(np.zeros(3, np.float64))


def test_names_and_codes():
    assert wire.output_dtype(pb.DTYPE_UNSPECIFIED) == "float32"
    with pytest.raises(wire.WireError, match="not an output dtype"):
        wire.output_dtype(pb.DTYPE_UINT8)
    assert [wire.kind_name(wire.kind_code(k)) for k in wire.OUTPUT_KINDS] == list(wire.OUTPUT_KINDS)
    with pytest.raises(wire.WireError, match="unknown output kind 'cls'"):
        wire.kind_code("cls")


def test_response_size_accounting_bounds_the_real_message():
    info = pb.ModelInfo(width=64, depth=4, heads=4, num_patches=16)
    kinds, layers = ["pooled", "patch_tokens", "attention_stats"], [0, -1]
    row = wire.row_bytes(info, kinds, layers, "float32")
    assert row == 4 * (64 + 2 * 16 * 64 + 2 * 4 * 4)
    n, ids = 5, [f"image-{i}.png" for i in range(5)]
    response = pb.EmbedResponse(
        model=pb.ModelRef(name="vit-22b-tiny/16", fingerprint="0" * 16, preprocess_hash="0" * 16),
        ids=ids,
        indices=range(n),
        timings=pb.Timings(queue_ms=1, total_ms=2),
        pooled=wire.to_tensor(np.zeros((n, 64), np.float32)),
        attention_entropy=wire.to_tensor(np.zeros((n, 4, 4), np.float32)),
        attention_max_logit=wire.to_tensor(np.zeros((n, 4, 4), np.float32)),
        patch_tokens={k: wire.to_tensor(np.zeros((n, 16, 64), np.float32)) for k in layers},
    )
    assert response.ByteSize() <= wire.response_bytes(row, ids)
