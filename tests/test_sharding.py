"""Tensor parallelism on 8 emulated CPU devices: equal outputs, one all-reduce a block, refusals."""

import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from peers import rel_err
from tiny_models import PARALLEL, SEQUENTIAL, images, random_params
from vit22b.model import OutputRequest, ViTConfig, apply, get_config
from vit22b.model.checkpoint import abstract_target, fingerprint, flatten
from vit22b.model.sharding import (
    MeshError,
    available_memory,
    batch_sharding,
    init_sharded,
    make_mesh,
    param_shardings,
    parse_mesh_spec,
    shard_params,
)

MESHES = ("data=1,model=8", "data=2,model=4", "data=8,model=1")
REQUEST = OutputRequest(pooled=True, patch_layers=(0, -1), attention_stats=True)


def _sharded_forward(cfg: ViTConfig, mesh):
    return jax.jit(
        lambda params, pixels: apply(cfg, params, pixels, REQUEST),
        in_shardings=(param_shardings(cfg, mesh), batch_sharding(mesh)),
    )


@pytest.mark.parametrize("cfg", [PARALLEL, SEQUENTIAL], ids=["parallel", "sequential"])
def test_sharded_forward_equals_single_device(cfg):
    pixels = images(cfg)
    params = random_params(cfg, seed=1)
    single = make_mesh("auto", jax.devices()[:1])
    want = _sharded_forward(cfg, single)(shard_params(cfg, params, single), pixels)
    for spec in MESHES:
        mesh = make_mesh(spec)
        got = _sharded_forward(cfg, mesh)(shard_params(cfg, params, mesh), pixels)
        for key in ("pooled", "attention_entropy", "attention_max_logit"):
            assert rel_err(got[key], want[key]) < 1e-5, (spec, key)
        for layer in (0, cfg.depth - 1):
            err = rel_err(got["patch_tokens"][layer], want["patch_tokens"][layer])
            assert err < 1e-5, (spec, layer)


def test_init_lands_in_its_sharding_with_the_same_values_as_on_one_device():
    cfg = PARALLEL.replace(depth=1)  # one block says it all, and compiles faster
    one_device = init_sharded(cfg, make_mesh("auto", jax.devices()[:1]), seed=1)
    params = init_sharded(cfg, make_mesh("data=2,model=4"), seed=1)
    assert fingerprint(params) == fingerprint(one_device)
    flat = flatten(params)
    assert flat["block_0/w_in"].sharding.spec == P(None, "model", None)
    assert flat["block_0/w_out"].sharding.spec == P("model", None, None)
    assert flat["map_head/w_kv"].sharding.spec == P(None, "model", None)
    assert flat["pos_embedding"].sharding.spec == P()
    # each device holds whole heads (8 over a model axis of 4): q|k|v (hd 8) + the MLP slice
    shards = {s.data.shape for s in flat["block_0/w_in"].addressable_shards}
    assert shards == {(64, 2, 3 * 8 + 256 // 8)}


def test_a_second_init_compiles_nothing_and_the_compute_dtype_leaves_the_values_alone():
    """The compiled init is kept per config and mesh (a process loading a preset again paid
    seconds of XLA compiles each time); the compute dtype, which init's forward runs in, must
    not change the parameters it returns."""
    compiles = []

    def listen(event, secs, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(secs)

    cfg = PARALLEL.replace(depth=1, compute_dtype="float32")
    mesh = make_mesh("data=2,model=4")
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        first = fingerprint(init_sharded(cfg, mesh, seed=7))
        before = len(compiles)
        again = init_sharded(cfg.replace(compute_dtype="bfloat16"), mesh, seed=7)
        assert len(compiles) == before  # fingerprint's host copies compiled above too
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert fingerprint(again) == first
    assert fingerprint(init_sharded(cfg, mesh, seed=8)) != first


def test_available_memory_is_the_smaller_of_the_hosts_and_the_cgroups_working_set_room(tmp_path):
    """A container's limit less its working set: the file cache the kernel reclaims (here 8 of
    the 9 MiB in use) does not count as used, or a cgroup full of cache would refuse a model
    that fits. (MiB limits: below any host's MemAvailable, which is read again at each call.)"""
    host = available_memory(tmp_path / "none")
    assert host is not None and host > 64 << 20  # /proc/meminfo's MemAvailable
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{10 << 20}\n")
    (v2 / "memory.current").write_text(f"{9 << 20}\n")
    (v2 / "memory.stat").write_text(f"anon {1 << 20}\ninactive_file {8 << 20}\n")
    assert available_memory(v2) == 9 << 20
    (v2 / "memory.max").write_text("max\n")  # no limit: the host's
    assert available_memory(v2) > 64 << 20
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{4 << 20}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{3 << 20}\n")
    (v1 / "memory.stat").write_text(f"inactive_file 0\ntotal_inactive_file {2 << 20}\n")
    assert available_memory(tmp_path / "v1") == 3 << 20


def _collectives_by_scope(hlo: str) -> dict[str, dict[str, int]]:
    """Count collective instructions in compiled HLO text by the module scope in their metadata.

    Scope is the flax module path in ``op_name`` (``.../ViT/block_3/...`` -> ``block_3``); async
    pairs count once (the ``-start`` half).
    """
    counts: dict[str, dict[str, int]] = {}
    pattern = re.compile(
        r"=\s*\S+\s+(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)"
        r"(?:-start)?\("
    )
    for line in hlo.splitlines():
        match = pattern.search(line)
        if not match:
            continue
        scope = re.search(r'op_name="[^"]*?/ViT/(block_\d+|map_head)/', line)
        name = scope[1] if scope else "<outside>"
        counts.setdefault(name, {}).setdefault(match[1], 0)
        counts[name][match[1]] += 1
    return counts


def _compiled_text(cfg: ViTConfig, spec: str) -> str:
    mesh = make_mesh(spec)
    params = abstract_target(cfg, mesh)  # shapes and shardings only: nothing is allocated
    batch = jax.ShapeDtypeStruct(
        (8, cfg.image_size, cfg.image_size, cfg.channels), np.float32, sharding=batch_sharding(mesh)
    )
    forward = jax.jit(lambda p, x: apply(cfg, p, x, OutputRequest(pooled=True)))
    return forward.lower(params, batch).compile().as_text()


def test_parallel_block_compiles_to_exactly_one_all_reduce():
    counts = _collectives_by_scope(_compiled_text(PARALLEL, "data=1,model=8"))
    for i in range(PARALLEL.depth):
        assert counts.get(f"block_{i}") == {"all-reduce": 1}, (i, counts)
    # nothing outside the blocks and the MAP head (split like a block: attention out, MLP out)
    assert set(counts) == {f"block_{i}" for i in range(PARALLEL.depth)} | {"map_head"}
    assert counts["map_head"] == {"all-reduce": 2}


def test_sequential_block_needs_two_all_reduces_on_a_data_and_model_mesh():
    counts = _collectives_by_scope(_compiled_text(SEQUENTIAL, "data=2,model=4"))
    for i in range(SEQUENTIAL.depth):
        assert counts.get(f"block_{i}") == {"all-reduce": 2}, (i, counts)
    assert set(counts) == {f"block_{i}" for i in range(SEQUENTIAL.depth)}


def test_long_attention_in_query_steps_shards_like_the_short_one():
    """290 tokens (over 2 x QUERY_BLOCK: the queries run in steps): on data=2,model=4 the same
    two all-reduces a block, nothing gathered, and the outputs of one device."""
    cfg = SEQUENTIAL.replace(image_size=136)
    counts = _collectives_by_scope(_compiled_text(cfg, "data=2,model=4"))
    for i in range(cfg.depth):
        assert counts.get(f"block_{i}") == {"all-reduce": 2}, (i, counts)
    pixels, params = images(cfg, n=4), random_params(cfg, seed=2)
    single = make_mesh("auto", jax.devices()[:1])
    want = _sharded_forward(cfg, single)(shard_params(cfg, params, single), pixels)
    mesh = make_mesh("data=2,model=4")
    got = _sharded_forward(cfg, mesh)(shard_params(cfg, params, mesh), pixels)
    for key in ("pooled", "attention_entropy", "attention_max_logit"):
        assert rel_err(got[key], want[key]) < 1e-5, key


def test_a_mesh_that_does_not_divide_the_heads_is_refused_naming_both():
    tiny = get_config("vit-22b-tiny/16")  # 4 heads
    with pytest.raises(MeshError, match=r"model axis \(8\) does not divide heads \(4\)"):
        param_shardings(tiny, make_mesh("data=1,model=8"))
    with pytest.raises(MeshError, match=r"model axis \(3\) does not divide heads \(4\)"):
        param_shardings(tiny, make_mesh("data=1,model=3", jax.devices()[:3]))


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("data=2,model=4", (2, 4)),
        ("model=8", (1, 8)),
        ("data=4", (4, 2)),
        ("auto", (8, 1)),
        (" data = 1 , model = 8 ", (1, 8)),
    ],
)
def test_mesh_spec_parsing(spec, expected):
    assert parse_mesh_spec(spec, 8) == expected


@pytest.mark.parametrize(
    "spec, message",
    [
        ("data=3,model=2", r"needs data\*model = 3\*2 = 6 devices, but 8 are available"),
        ("data=2,heads=4", r"expected 'data=N,model=M'"),
        ("data=0,model=8", r"must be positive"),
    ],
)
def test_bad_mesh_specs_are_refused_naming_the_numbers(spec, message):
    with pytest.raises(MeshError, match=message):
        parse_mesh_spec(spec, 8)
