"""The engine's execution plan changes speed, never results: pre-cast kernels, kernels stored
transposed, chunked batches (on one device and sharded over the data axis), the automatic mesh and
emulated CPU devices."""

import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from peers import rel_err
from tiny_models import PARALLEL, SEQUENTIAL, images, random_params
from vit22b.model import OutputRequest, ViTConfig, apply, get_config
from vit22b.model.checkpoint import expected_shapes, flatten
from vit22b.model.features import Features
from vit22b.model.forward import (
    MATMUL_KERNELS,
    cast_matmul_kernels,
    chunked_apply,
    from_levels,
    store_transposed,
)
from vit22b.model.pixels import level_table, normalise_formula
from vit22b.model.sharding import batch_sharding, make_mesh, param_shardings, shard_params
from vit22b.model.vit import CONTRACTED_AXES, Execution
from vit22b.server import cpu_devices
from vit22b.server.engine import Engine, auto_mesh
from vit22b.server.plan import (
    CPU_CHUNK_BYTES,
    CPU_DATA_PARALLEL,
    CPU_MIN_ROW_FLOPS,
    CPU_TRANSPOSED_KERNELS,
    Plan,
    auto_compute_dtype,
    largest_divisor,
    step_bytes_per_image,
)

REQUEST = OutputRequest(pooled=True, patch_layers=(0, -1), attention_stats=True)
CONFIGS = [PARALLEL, SEQUENTIAL.replace(num_classes=5)]
IDS = ["parallel", "sequential"]
# bf16 rounding of an f32 value that differs in its last bit can flip: rows agree to about 1e-3
# when the GEMM blocks a batch differently; f32 agrees to rounding.
TOLERANCE = {"float32": 1e-5, "bfloat16": 5e-3}


def chunk_images(cfg: ViTConfig, platform: str, local: int, override: int | None = None) -> int:
    """The plan's images per step for one device holding ``local`` images."""
    plan = Plan.make(cfg, platform=platform, data=1, process_count=1, max_batch_images=local,
                     chunk_images=override, small_buckets=False)
    return plan.chunk_images(local)


def _outputs(result: dict | Features) -> dict[str, np.ndarray]:
    if isinstance(result, Features):
        result = {**dict(result.arrays()), "patch_tokens": result.patch_tokens}
    flat = {k: v for k, v in result.items() if k != "patch_tokens"}
    flat.update({f"patch_{k}": v for k, v in result.get("patch_tokens", {}).items()})
    return {k: np.asarray(v) for k, v in flat.items()}


def _assert_same(got: dict, want: dict, tol: float) -> None:
    got, want = _outputs(got), _outputs(want)
    assert set(got) == set(want)
    for key in want:
        assert got[key].shape == want[key].shape, key
        assert rel_err(got[key], want[key]) <= tol, (key, rel_err(got[key], want[key]))


def _forward(cfg: ViTConfig, request=REQUEST, chunk: int | None = None, shards: int = 1):
    if chunk is None:
        return jax.jit(lambda p, x: apply(cfg, p, x, request))
    return jax.jit(lambda p, x: chunked_apply(cfg, p, x, request, chunk, shards))


# ---- pre-cast kernels ----------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_every_matmul_kernel_is_cast_and_nothing_else(cfg):
    cfg = cfg.replace(compute_dtype="bfloat16")
    cast = flatten(cast_matmul_kernels(cfg, random_params(cfg, seed=1)))
    embeddings = {"pos_embedding", "cls", "probe"}  # added to activations in f32, not matmuls
    for path, (shape, _) in expected_shapes(cfg).items():
        name = path.split("/")[-1]
        if len(shape) >= 2 and name not in embeddings and not name.startswith("b_"):
            assert name in MATMUL_KERNELS, f"{path} is a matrix the plan does not pre-cast"
        want = "bfloat16" if name in MATMUL_KERNELS else "float32"
        assert cast[path].dtype == np.dtype(want), path


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_precast_kernels_give_the_outputs_of_the_original_parameters(cfg):
    cfg = cfg.replace(compute_dtype="bfloat16")
    params, pixels = random_params(cfg, seed=1), images(cfg)
    request = OutputRequest(
        pooled=True, patch_layers=(0,), attention_stats=True, logits=cfg.num_classes > 0
    )
    want = _forward(cfg, request)(params, pixels)
    got = _forward(cfg, request)(cast_matmul_kernels(cfg, params), pixels)
    _assert_same(got, want, 1e-6)


def test_f32_compute_leaves_the_parameters_alone():
    params = random_params(PARALLEL, seed=1)
    cast = cast_matmul_kernels(PARALLEL, params)
    assert all(a is b for a, b in zip(jax.tree.leaves(cast), jax.tree.leaves(params)))


# ---- chunked batches -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_chunked_forward_equals_the_whole_batch(cfg, dtype):
    cfg = cfg.replace(compute_dtype=dtype)
    params, pixels = random_params(cfg, seed=2), images(cfg, n=8)
    want = _forward(cfg)(params, pixels)
    for chunk in (1, 2, 4):
        _assert_same(_forward(cfg, chunk=chunk)(params, pixels), want, TOLERANCE[dtype])


@pytest.mark.parametrize("shards", [1, 2])
def test_a_chunked_forward_runs_only_its_active_steps(shards):
    """With ``active`` k, the first k steps (rows [i * chunk, (i + 1) * chunk) of every shard for
    step i) equal the whole batch's rows and the skipped steps' rows are zeros; one program
    serves every k."""
    cfg = SEQUENTIAL
    params, pixels = random_params(cfg, seed=5), images(cfg, n=8)
    want = _outputs(_forward(cfg)(params, pixels))
    chunk = 2 // shards  # four steps either way
    fn = jax.jit(lambda p, x, k: chunked_apply(cfg, p, x, REQUEST, chunk, shards, active=k))
    for active in (0, 1, 3, 4, 9):
        got = _outputs(fn(params, pixels, np.int32(active)))
        ran = np.zeros((shards, 4, chunk), bool)
        ran[:, : min(active, 4)] = True
        ran = ran.reshape(-1)  # row r of shard s is step (r % (8 / shards)) // chunk
        assert set(got) == set(want)
        for key in want:
            assert got[key].shape == want[key].shape, key
            if ran.any():
                assert rel_err(got[key][ran], want[key][ran]) <= 1e-6, (key, active)
            assert not got[key][~ran].any(), (key, active)
    assert fn._cache_size() == 1


@pytest.mark.parametrize("name", ["vit-22b-tiny/16", "vit-b/16", "siglip-b/16", "clip-b/16"])
def test_levels_are_normalised_in_the_forward_bit_for_bit(name):
    """``from_levels`` compiled gives the host's table (the contract's float32 formula) at every
    level of every channel; XLA compiling the formula itself would round differently."""
    p = get_config(name).preprocess
    every = np.stack(np.meshgrid(np.arange(256), np.arange(256), indexing="ij"), -1)
    grid = np.concatenate([every, every[..., :1]], -1).astype(np.uint8)[None]  # [1, 256, 256, 3]
    got = np.asarray(jax.jit(lambda x: from_levels(level_table(p), x))(grid))
    want = normalise_formula(grid, p)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("shards", [1, 2])
def test_a_chunked_forward_of_levels_is_the_forward_of_their_normalised_values(shards):
    """uint8 levels normalised per step give the bits of the host-normalised batch, in one step
    and in several (a loop over chunks, some skipped); the wrong pairing is refused."""
    cfg = PARALLEL
    params = random_params(cfg, seed=9)
    levels = np.random.default_rng(3).integers(0, 256, images(cfg, n=8).shape, dtype=np.uint8)
    table = level_table(cfg.preprocess)
    normalised = normalise_formula(levels, cfg.preprocess)
    def run(x, chunk, active, table=None):
        return _outputs(jax.jit(lambda p, x, k: chunked_apply(
            cfg, p, x, REQUEST, chunk, shards, active=k, levels=table))(params, x, active))

    for chunk in (8 // shards, 1):  # one step; eight steps, of which three run
        for active in (None, np.int32(3)):
            floats = run(normalised, chunk, active)
            of_levels = run(levels, chunk, active, table)
            assert set(of_levels) == set(floats)
            for key in floats:
                np.testing.assert_array_equal(of_levels[key], floats[key], err_msg=key)
    with pytest.raises(ValueError, match="uint8 images need the normalisation's table"):
        chunked_apply(cfg, params, levels, REQUEST, 8)
    with pytest.raises(ValueError, match="got float32 images and a table"):
        chunked_apply(cfg, params, normalised, REQUEST, 8, levels=table)


def test_chunks_that_do_not_divide_the_batch_are_refused():
    pixels = images(PARALLEL, n=6)
    with pytest.raises(ValueError, match="chunks of 4 images on each of 1 shards"):
        chunked_apply(PARALLEL, random_params(PARALLEL), pixels, REQUEST, chunk=4)
    with pytest.raises(ValueError, match="chunks of 2 images on each of 2 shards"):
        chunked_apply(PARALLEL, random_params(PARALLEL), pixels, REQUEST, chunk=2, shards=2)


# ---- kernels stored transposed ------------------------------------------------------------------

# every kernel that may be stored transposed, in every module that has one: the parallel block
# and its MAP head; sequential blocks with GELU and with SwiGLU, and a MAP head whose MLP
# kernels are square (64 x 64), which a module reading them as stored would take silently
TRANSPOSABLE = [PARALLEL, SEQUENTIAL.replace(head="map", head_mlp_dim=64),
                SEQUENTIAL.replace(mlp="swiglu", num_classes=5)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cfg", TRANSPOSABLE, ids=["parallel", "sequential-map", "swiglu"])
def test_kernels_stored_transposed_give_the_outputs_of_the_kernels_as_stored(cfg, dtype):
    cfg = cfg.replace(compute_dtype=dtype)
    names = frozenset(CONTRACTED_AXES)
    params, pixels = random_params(cfg, seed=8), images(cfg, n=4)
    stored = store_transposed(params, names)
    flat, moved = flatten(params), flatten(stored)
    for path, w in flat.items():  # contracted axes last; everything else as it was
        c = CONTRACTED_AXES.get(path.rsplit("/", 1)[-1])
        axes = tuple(range(w.ndim)) if c is None else (*range(c, w.ndim), *range(c))
        np.testing.assert_array_equal(moved[path], np.transpose(w, axes), err_msg=path)
    want = _forward(cfg)(params, pixels)
    # and with the MLP's activation and fc2 in token slices (3: of unequal sizes)
    for execution in (Execution(transposed=names), Execution(transposed=names, mlp_slices=3)):
        got = jax.jit(lambda p, x, e=execution: apply(cfg, p, x, REQUEST, execution=e))
        _assert_same(got(stored, pixels), want, 1e-6)  # the same products, summed alike
        stepped = jax.jit(
            lambda p, x, e=execution: chunked_apply(cfg, p, x, REQUEST, 1, execution=e))
        _assert_same(stepped(stored, pixels), want, TOLERANCE[dtype])
    sliced = jax.jit(lambda p, x: apply(cfg, p, x, REQUEST, execution=Execution(mlp_slices=4)))
    _assert_same(sliced(params, pixels), want, 1e-6)


def test_the_plan_transposes_the_down_projections_in_bf16_on_a_single_process_amx_cpu_host():
    amx, avx512 = frozenset({"avx512f", "avx512_bf16", "amx_bf16"}), frozenset({"avx512f"})

    def plan(**kw) -> Plan:
        return Plan.make(**{"cfg": PARALLEL.replace(compute_dtype="bfloat16"), "platform": "cpu",
                            "data": 2, "process_count": 1, "max_batch_images": 8,
                            "cpu_flags": amx, **kw})

    assert plan().transposed_kernels == CPU_TRANSPOSED_KERNELS == {"w_fc2", "w_out"}
    assert plan().compiler_options and "transposed: w_fc2, w_out" in plan().table()
    for other in (dict(cpu_flags=avx512), dict(cpu_flags=None), dict(model=2),
                  dict(process_count=2), dict(platform="gpu"), dict(cfg=PARALLEL),  # f32
                  dict(transpose_kernels=False)):
        assert not plan(**other).transposed_kernels and not plan(**other).compiler_options, other
    assert plan(cpu_flags=None, transpose_kernels=True).transposed_kernels
    # the MLP in slices: with the transposed fc2, for sequential blocks, by the bytes of fc2's
    # input per device and step (ViT-B/16: 4 images x 197 tokens x 3072 x 2 B = 4.8 MB)
    vit_b = get_config("vit-b/16").replace(compute_dtype="bfloat16")
    assert plan(cfg=vit_b).chunk_images(8) == 4 and plan(cfg=vit_b).mlp_slices(8) == 4
    assert plan(cfg=vit_b, transpose_kernels=False).mlp_slices(8) == 1
    assert plan().mlp_slices(8) == 1  # a parallel block: its MLP is fused into w_out
    assert plan(cfg=vit_b, mlp_slices=2).mlp_slices(8) == 2
    assert "MLP in 4 slices" in plan(cfg=vit_b).table()
    with pytest.raises(ValueError, match="mlp_slices must be >= 1"):
        plan(mlp_slices=0)
    with pytest.raises(ValueError, match="need a model axis of 1, not 2"):
        plan(model=2, transpose_kernels=True)


def _weight_copies(hlo: str) -> int:
    """Copies of an entry parameter to another layout (a kernel materialised anew per call)."""
    return len(re.findall(r"\{1,0\} copy\(%param", hlo))


@pytest.mark.parametrize("cfg", [PARALLEL, SEQUENTIAL], ids=IDS)
def test_a_chunked_forward_reads_transposed_kernels_where_they_are(cfg):
    """XLA's loop-invariant code motion would hoist each transposed kernel's transpose out of
    the chunks' loop and copy it there, every call: the plan compiles with it off."""
    cfg = cfg.replace(compute_dtype="bfloat16")
    params, mesh = random_params(cfg, seed=9), make_mesh("data=2,model=1", jax.devices()[:2])

    def engine(transpose: bool) -> Engine:
        return Engine(cfg, shard_params(cfg, params, mesh), mesh, fingerprint="f", source="s",
                      max_batch_images=8, chunk_images=1, small_buckets=False,
                      transpose_kernels=transpose)

    on, off = engine(True), engine(False)
    assert on.plan.chunk_images(8) == 1  # four steps a forward: a loop
    request = on.resolve(REQUEST)
    lowered = on.lowered(8, request, on.grid)
    assert _weight_copies(on.compiled(8, request).as_text()) == 0
    assert _weight_copies(lowered.compile().as_text()) > 0  # the pass on: copies
    pixels = images(cfg, n=8)
    _assert_same(on.forward(pixels, request), off.forward(pixels, request), 1e-6)
    on.close()
    off.close()


# ---- attention's heads folded into its batch axis ------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_folded_heads_give_the_outputs_of_the_unfolded_attention(cfg, dtype):
    cfg = cfg.replace(compute_dtype=dtype)
    params, pixels = random_params(cfg, seed=5), images(cfg, n=4)
    folded = jax.jit(lambda p, x: apply(cfg, p, x, REQUEST, execution=Execution(fold_heads=True)))(
        params, pixels)
    # the same GEMMs per head, the same order of sums: equal up to f32 rounding in both dtypes
    _assert_same(folded, _forward(cfg)(params, pixels), 1e-6)


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("cfg", [PARALLEL.replace(image_size=288),
                                 SEQUENTIAL.replace(image_size=136, num_classes=5)],
                         ids=IDS)
def test_long_attention_in_query_steps_equals_all_queries_at_once(cfg, fold, monkeypatch):
    """324 and 290 tokens: over 2 x QUERY_BLOCK, so the queries run in steps (3 of 112 and of
    104 rows, the last padded); the outputs and the attention statistics are those of one step."""
    from vit22b.model import vit

    params, pixels = random_params(cfg, seed=6), images(cfg, n=2)
    assert cfg.grid ** 2 + int(cfg.class_token) > 2 * vit.QUERY_BLOCK

    def forward():
        fn = jax.jit(lambda p, x: apply(cfg, p, x, REQUEST, execution=Execution(fold_heads=fold)))
        return fn(params, pixels), "while" in fn.lower(params, pixels).as_text()

    stepped, loops = forward()
    monkeypatch.setattr(vit, "QUERY_BLOCK", 10**6)
    whole, no_loops = forward()
    assert loops and not no_loops  # the steps are a loop, one per block (the MAP head's: none)
    _assert_same(stepped, whole, 1e-6)


def _attention_batch_dims(hlo: str) -> set[str]:
    """The batch dimensions of the compiled forward's batched products (attention's)."""
    return set(re.findall(r"lhs_batch_dims=\{([\d,]+)\}", hlo))


@pytest.mark.parametrize("spec, folded", [("data=8,model=1", True), ("data=2,model=4", False)])
def test_the_engine_folds_the_heads_only_where_its_mesh_does_not_shard_them(spec, folded):
    """Folding [B, H] into one axis is free on a data-only mesh; with the heads sharded too the
    merged axis cannot be split, and GSPMD would gather q, k and v on every block instead."""
    cfg = PARALLEL
    mesh = make_mesh(spec)
    engine = Engine(cfg, shard_params(cfg, random_params(cfg), mesh), mesh, fingerprint="f",
                    source="s", max_batch_images=8, small_buckets=False)
    hlo = engine.compiled(8, engine.resolve(REQUEST)).as_text()
    assert _attention_batch_dims(hlo) == ({"0"} if folded else {"0,1"})
    assert "all-gather" not in _collectives(hlo), _collectives(hlo)
    engine.close()


def _collectives(hlo: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    pattern = r"=\s*\S+\s+(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)"
    for kind in re.findall(pattern + r"(?:-start)?\(", hlo):
        counts[kind] = counts.get(kind, 0) + 1
    return counts


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_chunks_of_a_sharded_batch_stay_on_their_devices(cfg):
    """On data=2,model=4 a chunked forward equals the single-device whole batch, and compiles to
    the same collectives as the unchunked sharded one (the tensor-parallel all-reduces): every
    chunk takes its rows from each data shard, so no row moves between devices."""
    params, pixels = random_params(cfg, seed=3), images(cfg, n=8)
    want = _forward(cfg)(params, pixels)
    mesh = make_mesh("data=2,model=4")
    shardings = (param_shardings(cfg, mesh), batch_sharding(mesh))
    sharded = shard_params(cfg, params, mesh)
    batch = jax.device_put(pixels, batch_sharding(mesh))
    whole = jax.jit(lambda p, x: apply(cfg, p, x, REQUEST), in_shardings=shardings)
    expected = _collectives(whole.lower(sharded, batch).compile().as_text())
    assert expected.get("all-reduce") and set(expected) == {"all-reduce"}
    for chunk in (1, 2):
        fn = jax.jit(
            lambda p, x, c=chunk: chunked_apply(cfg, p, x, REQUEST, c, shards=2),
            in_shardings=shardings,
        )
        compiled = fn.lower(sharded, batch).compile()
        assert _collectives(compiled.as_text()) == expected, chunk
        _assert_same(compiled(sharded, batch), want, TOLERANCE["float32"])


# ---- the engine's choices ------------------------------------------------------------------------


def test_chunk_size_rule():
    vit_b = get_config("vit-b/16")  # 197 tokens, MLP 3072: 2.4 MB of f32 activation per image
    per_image = step_bytes_per_image(vit_b)
    assert per_image == 4 * 197 * 3072
    for dtype in ("float32", "bfloat16"):
        cfg = vit_b.replace(compute_dtype=dtype)
        for local in (1, 2, 4, 8, 16, 32):
            chunk = chunk_images(cfg, "cpu", local)
            assert local % chunk == 0
            assert chunk == 1 or chunk * per_image <= CPU_CHUNK_BYTES
            assert chunk == local or 2 * chunk * per_image > CPU_CHUNK_BYTES  # the largest
            assert chunk_images(cfg, "gpu", local) == local  # chunks are a CPU plan
            assert chunk_images(cfg, "cpu", local, override=0) == local
        assert chunk_images(cfg, "cpu", 16) == 4  # measured best (benchmarks/NOTES.md)
    tiny = get_config("vit-22b-tiny/16")  # 16 tokens: nothing to chunk in buckets up to 32
    assert chunk_images(tiny, "cpu", 32) == 32
    assert chunk_images(vit_b, "gpu", 8, override=3) == 2  # a divisor of the local batch
    assert [largest_divisor(12, limit) for limit in (0, 1, 5, 6, 100)] == [1, 1, 4, 6, 12]


def test_auto_mesh_on_a_cpu_host_follows_the_compute_dtype():
    for dtype, devices in CPU_DATA_PARALLEL.items():
        mesh = auto_mesh(PARALLEL.replace(compute_dtype=dtype))
        assert dict(mesh.shape) == {"data": devices, "model": 1}
        assert list(mesh.devices.flat) == jax.devices()[:devices]


@pytest.fixture(scope="module")
def tiny_engines() -> dict[str, Engine]:
    """The default tiny model (bf16 compute, f32 parameters) on data=2,model=4, four ways."""
    cfg = get_config("vit-22b-tiny/16").replace(heads=8)
    params = random_params(cfg, seed=4)
    mesh = make_mesh("data=2,model=4")

    def engine(**kw) -> Engine:
        return Engine(
            cfg, shard_params(cfg, params, mesh), mesh, fingerprint="f", source="s",
            max_batch_images=8, **kw,
        )

    return {
        "plain": engine(chunk_images=0, precast=False, small_buckets=False),
        "precast": engine(chunk_images=0, small_buckets=False),
        "chunked": engine(chunk_images=1, small_buckets=False),
        "auto": engine(),  # the plan: pre-cast, chunks, small buckets (CPU, one process)
    }


def test_engine_forward_is_the_same_with_and_without_its_levers(tiny_engines):
    plain, precast, chunked = (tiny_engines[k] for k in ("plain", "precast", "chunked"))
    assert chunked.plan.chunk_images(8) == 1 and plain.plan.chunk_images(8) == 4
    assert plain.parameter_count == precast.parameter_count == chunked.parameter_count
    w_in = flatten(precast.params)["block_0/w_in"]
    assert w_in.dtype == np.dtype("bfloat16") and w_in.sharding.spec[1] == "model"
    assert flatten(plain.params)["block_0/w_in"].dtype == np.float32
    request = plain.resolve(OutputRequest(pooled=True, patch_layers=(-1,), attention_stats=True))
    pixels = images(plain.cfg, n=7)  # padded to the bucket of 8
    want = plain.forward(pixels, request)
    _assert_same(precast.forward(pixels, request), want, 1e-6)
    _assert_same(chunked.forward(pixels, request), want, TOLERANCE["bfloat16"])


def test_a_padded_batch_skips_the_steps_of_padding_alone(tiny_engines):
    """Chunks of one image on 2 shards of 4 rows (bucket 8): 3 images would go to rows 0, 1
    (shard 0) and 4 (shard 1) and run in 2 of the 4 steps; the features are those of every step
    run, in the images' order, and the padding rows the executor gets are zeros."""
    chunked = tiny_engines["chunked"]
    every = Engine(chunked.cfg, chunked.params, chunked.mesh, fingerprint="f", source="s",
                   max_batch_images=8, chunk_images=1, small_buckets=False, precast=False,
                   skip_padding=False)
    rows, active = chunked.layout(3, 8)
    assert rows.tolist() == [0, 1, 4] and active == 2 and chunked.steps(8) == 4
    rows, active = every.layout(3, 8)
    assert rows.tolist() == [0, 1, 2] and active == 4  # skip_padding=False: every step
    rows, active = chunked.layout(5, 8)
    assert rows.tolist() == [0, 1, 2, 4, 5] and active == 3
    assert chunked.layout(8, 8)[1] == 4
    request = chunked.resolve(OutputRequest(pooled=True, patch_layers=(-1,), attention_stats=True))
    seen = []

    class Recording:
        def __init__(self, inner):
            self.inner = inner

        def check(self):
            pass

        def run(self, engine, bucket, outputs, pixels, active=None):
            seen.append((pixels.copy(), active))
            return self.inner.run(engine, bucket, outputs, pixels, active)

    chunked.executor = Recording(chunked.executor)
    try:
        for n in (3, 5, 6, 8):  # buckets of 4 (two steps, both with images) and 8
            pixels = images(chunked.cfg, n=n, seed=n)
            got = chunked.forward(pixels, request)
            _assert_same(got, every.forward(pixels, request), 1e-6)
            sent, active = seen[-1]
            rows, want_active = chunked.layout(n, chunked.bucket(n))
            assert active == want_active
            np.testing.assert_array_equal(sent[rows], pixels)
            assert not np.delete(sent, rows, axis=0).any()
    finally:
        chunked.executor = chunked.executor.inner
    hlo = chunked.compiled(8, request).as_text()
    assert "all-gather" not in _collectives(hlo), _collectives(hlo)
    every.close()


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_every_layout_puts_each_image_in_a_step_that_runs(chunk):
    """For every batch size on 4 data rows: distinct rows inside the bucket, each image's step
    (its row's place in its shard, over the chunk) below the steps run, and fewer steps only
    where a step held padding alone."""
    cfg = get_config("vit-22b-tiny/16").replace(heads=8)
    mesh = make_mesh("data=4,model=2")
    engine = Engine(cfg, shard_params(cfg, random_params(cfg, seed=6), mesh), mesh,
                    fingerprint="f", source="s", max_batch_images=48, chunk_images=chunk,
                    small_buckets=False)
    for n in range(1, 49):
        bucket = engine.bucket(n)
        rows, active = engine.layout(n, bucket)
        shards = engine.plan.rows(bucket, engine.grid)
        local, per_step = bucket // shards, engine.plan.chunk_images(bucket, engine.grid)
        assert len(rows) == n == len(set(rows.tolist())) and rows.max() < bucket, n
        steps_of_images = (rows % local) // per_step
        assert 1 <= active <= engine.steps(bucket) and steps_of_images.max() == active - 1, n
    engine.close()


def test_midpoint_buckets_where_the_chunk_steps_cannot_skip_the_padding():
    """On a single-process CPU host a bucket 3a/2 sits between a and 2a where a batch of 3a/2
    images would compute fewer rows in it than in 2a, on the same data rows."""
    def plan(name: str, dtype: str = "float32", **kw) -> Plan:
        cfg = get_config(name).replace(compute_dtype=dtype)
        return Plan.make(cfg, **{"platform": "cpu", "data": 2, "process_count": 1,
                                 "max_batch_images": 32, **kw})

    tiny = plan("vit-22b-tiny/16")  # one step per shard in every bucket: every midpoint
    assert tiny.buckets == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
    assert tiny.work(20, 32) == 32 and tiny.work(20, 24) == 24 and tiny.work(3, 4) == 4
    # ViT-B/16 runs 4 images per shard and step: 17-24 images in bucket 32 take 3 of its 4
    # steps already (24 rows), so no 24; 9-12 in 16 take 2 steps of 4 (16), in 12 of 3 (12)
    vit_b = plan("vit-b/16")
    assert vit_b.buckets == (1, 2, 4, 6, 8, 12, 16, 32)
    assert vit_b.work(20, 32) == 24 and vit_b.work(12, 16) == 16 and vit_b.work(12, 12) == 12
    assert plan("vit-b/16", "bfloat16").buckets == vit_b.buckets
    # 3 images would run on one row, 4 on two: not the same placement, no 3
    assert 3 not in vit_b.buckets and vit_b.rows(4) == 2
    for other in (plan("vit-22b-tiny/16", platform="gpu"),
                  plan("vit-22b-tiny/16", process_count=2),
                  plan("vit-22b-tiny/16", small_buckets=False, midpoints=False)):
        assert other.buckets == (2, 4, 8, 16, 32)  # accelerators, groups: powers of two
    assert plan("vit-22b-tiny/16", small_buckets=False).buckets == (2, 4, 6, 8, 12, 16, 24, 32)


def test_a_batch_smaller_than_the_data_axis_runs_on_one_row(tiny_engines):
    auto, padded = tiny_engines["auto"], tiny_engines["precast"]
    assert padded.buckets == (2, 4, 6, 8) and auto.buckets == (1, 2, 3, 4, 6, 8)  # midpoints
    row = auto.placement(1)
    assert dict(row.mesh.shape) == {"data": 1, "model": 4}
    assert list(row.mesh.devices.flat) == list(auto.mesh.devices[0])
    # the row's parameters are the buffers its devices already held, not copies
    full, mine = flatten(auto.params)["block_0/w_in"], flatten(row.params)["block_0/w_in"]
    held = {s.device: s.data.unsafe_buffer_pointer() for s in full.addressable_shards}
    assert {s.device: s.data.unsafe_buffer_pointer() for s in mine.addressable_shards} == {
        d: held[d] for d in row.mesh.devices.flat
    }
    request = auto.resolve(OutputRequest(pooled=True, patch_layers=(0,)))
    pixels = images(auto.cfg, n=1)
    want = padded.forward(pixels, request)
    _assert_same(auto.forward(pixels, request), want, TOLERANCE["bfloat16"])
    assert auto.placement(2) is row  # the tiny model's 2-8 images: too little work for two


def test_a_bucket_takes_the_rows_its_work_pays_for(tiny_engines):
    """Rows by work (``CPU_MIN_ROW_FLOPS``): a row's program costs a fixed CPU time, so a bucket
    runs on as many data rows as each get enough work, at the grid of its images."""
    auto, padded = tiny_engines["auto"], tiny_engines["precast"]
    tiny = auto.cfg
    assert 8 * tiny.flops_per_image() < 2 * CPU_MIN_ROW_FLOPS <= 16 * tiny.flops_per_image()
    assert [auto.plan.rows(b) for b in auto.buckets] == [1, 1, 1, 1, 1, 1]
    assert [padded.plan.rows(b) for b in padded.buckets] == [2, 2, 2, 2]  # fewer rows off
    assert auto.plan.rows(2, (16, 16)) == 2  # 257 tokens an image: both rows
    assert auto.placement(2, (16, 16)) is auto.placement(8, (16, 16))
    assert dict(auto.placement(2, (16, 16)).mesh.shape) == {"data": 2, "model": 4}

    def plan(name: str, data: int, max_images: int, **kw) -> Plan:
        return Plan.make(get_config(name), platform="cpu", data=data, process_count=1,
                         max_batch_images=max_images, **kw)

    bigger = plan("vit-22b-tiny/16", 2, 64)
    assert [(b, bigger.rows(b)) for b in bigger.buckets] == [
        (1, 1), (2, 1), (3, 1), (4, 1), (6, 1), (8, 1), (12, 2), (16, 2), (24, 2), (32, 2),
        (48, 2), (64, 2)]
    assert bigger.chunk_images(8) == 8 and bigger.chunk_images(16) == 8  # per row
    vit_ti = plan("vit-ti/16", 2, 8)
    assert [(b, vit_ti.rows(b)) for b in vit_ti.buckets] == [(1, 1), (2, 2), (4, 2), (6, 2),
                                                             (8, 2)]
    odd = plan("vit-ti/16", 3, 12)  # a row count that must divide the bucket
    assert [(b, odd.rows(b)) for b in odd.buckets] == [(1, 1), (2, 2), (3, 3), (6, 3), (9, 3),
                                                       (12, 3)]
    group = Plan.make(tiny, platform="cpu", data=2, process_count=2, max_batch_images=8)
    assert [group.rows(b) for b in group.buckets] == [2, 2, 2]  # every process takes part
    gpu = Plan.make(tiny, platform="gpu", data=2, process_count=1, max_batch_images=8)
    assert [gpu.rows(b) for b in gpu.buckets] == [2, 2, 2]
    # a bucket on one row computes what the mesh computes
    request = auto.resolve(OutputRequest(pooled=True, patch_layers=(0,)))
    pixels = images(tiny, n=7)
    _assert_same(auto.forward(pixels, request), padded.forward(pixels, request),
                 TOLERANCE["bfloat16"])


def test_negative_chunk_override_is_refused():
    cfg = get_config("vit-22b-tiny/16")
    mesh = make_mesh("data=1", jax.devices()[:1])
    with pytest.raises(ValueError, match="chunk_images must be >= 0"):
        Engine(cfg, random_params(cfg), mesh, fingerprint="f", source="s", chunk_images=-1)


# ---- emulated CPU devices (the server's command line, before jax starts) -------------------------


def _after_cli_import(xla_flags: str | None) -> tuple[int, str]:
    """(CPU devices, XLA_FLAGS) in a fresh process once the server's command line is imported."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    code = ("import os, vit22b.server.cli, jax; print(jax.device_count('cpu')); "
            "print(os.environ['XLA_FLAGS'])")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    count, flags = out.stdout.strip().splitlines()[-2:]
    return int(count), flags


def test_server_cli_asks_for_emulated_cpu_devices_unless_the_user_chose():
    assert _after_cli_import(None)[0] == min(os.cpu_count() or 1, 2)
    assert _after_cli_import("--xla_force_host_platform_device_count=3")[0] == 3


def test_server_cli_asks_for_wide_vectors_only_on_avx512_and_unless_the_user_chose():
    with open("/proc/cpuinfo") as f:
        avx512 = any(line.startswith("flags") and " avx512f" in line for line in f)
    flags = _after_cli_import(None)[1]
    assert ("--xla_cpu_prefer_vector_width=512" in flags) == avx512, flags
    flags = _after_cli_import("--xla_cpu_prefer_vector_width=128")[1]
    assert "--xla_cpu_prefer_vector_width=128" in flags and "=512" not in flags, flags


def test_auto_compute_dtype_is_float32_only_where_bf16_would_be_emulated():
    avx2 = frozenset({"fma", "avx2"})
    for flags in ({"avx512f", "avx512_bf16"}, {"amx_bf16", "amx_tile"}, {"asimd", "bf16"}):
        assert auto_compute_dtype("bfloat16", "cpu", frozenset(flags)) == ("bfloat16", "")
    dtype, why = auto_compute_dtype("bfloat16", "cpu", avx2)
    assert dtype == "float32" and "no bf16 instructions" in why
    assert auto_compute_dtype("float32", "cpu", avx2) == ("float32", "")
    assert auto_compute_dtype("bfloat16", "gpu", avx2) == ("bfloat16", "")
    assert auto_compute_dtype("bfloat16", "cpu", None) == ("bfloat16", "")  # unknown host


def test_cpu_flags_read_this_host():
    flags = cpu_devices.cpu_flags()
    if sys.platform.startswith("linux"):
        assert flags and ("fpu" in flags or "fp" in flags)  # x86 and Arm both list them


def test_engine_load_resolves_auto_by_the_host(monkeypatch, caplog):
    """``auto`` (the server's and local jobs' default) on a host without bf16 instructions
    computes float32, which every served identity then names; an explicit bf16 there is kept
    and warned about; ``None`` keeps the preset's everywhere."""
    import vit22b.server.engine as engine_module

    mesh = make_mesh("data=1,model=1", jax.devices()[:1])
    monkeypatch.setattr(engine_module, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    with caplog.at_level("INFO", logger=engine_module.__name__):
        auto = Engine.load("vit-22b-tiny/16", mesh=mesh, compute_dtype="auto")
    assert auto.cfg.compute_dtype == auto.identity.compute_dtype == "float32"
    assert "no bf16 instructions" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger=engine_module.__name__):
        forced = Engine.load("vit-22b-tiny/16", mesh=mesh, compute_dtype="bfloat16")
    assert forced.cfg.compute_dtype == "bfloat16" and "slower than float32" in caplog.text
    assert Engine.load("vit-22b-tiny/16", mesh=mesh).cfg.compute_dtype == "bfloat16"
    monkeypatch.setattr(engine_module, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert Engine.load("vit-22b-tiny/16", mesh=mesh, compute_dtype="auto").cfg.compute_dtype \
        == "bfloat16"
    caplog.clear()
    monkeypatch.setattr(engine_module, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    with caplog.at_level("INFO", logger=engine_module.__name__):  # the auto mesh's path too
        on_auto_mesh = Engine.load("vit-22b-tiny/16", compute_dtype="auto")
    assert on_auto_mesh.cfg.compute_dtype == "float32"
    assert caplog.text.count("no bf16 instructions") == 1  # decided, and said, once
    for engine in (auto, forced, on_auto_mesh):
        engine.close()
