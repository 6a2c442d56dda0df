"""Weight import, checked against the peers' own code: timm's and Hugging Face's models (random,
tiny, perturbed so that no bias or norm is trivially zero or one) exported, converted, and run on
the same pixels. big_vision files are checked through timm's own big_vision .npz loader."""

import json
import os
import re
from functools import partial

import jax
import numpy as np
import pytest
import torch
from parity import check_parity, compiled_apply
from peers import import_timm, perturb, rel_err, uses_stand_in
from safetensors.torch import save_file
from vit22b.clients.cli import main
from vit22b.model import OutputRequest, apply, get_config
from vit22b.model import checkpoint as ckpt
from vit22b.model.convert import ConvertError, Hints, convert
from vit22b.model.sharding import available_memory, batch_sharding, make_mesh, param_shardings

timm = import_timm()
from timm.models._hub import save_config_for_hf  # noqa: E402
from timm.models.vision_transformer import ParallelScalingBlock, VisionTransformer  # noqa: E402

TOL = 1e-4  # relative error, f32
TINY = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4)
FEATURES = OutputRequest(pooled=True, patch_layers=(-1,), norm_patches=True)
EVERYTHING = OutputRequest(pooled=True, patch_layers=(-1,), norm_patches=True, logits=True)


def _pixels(n: int = 2, size: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _ours(converted, pixels: torch.Tensor, request: OutputRequest = EVERYTHING) -> dict:
    cfg = converted.config.replace(compute_dtype="float32")
    return compiled_apply(cfg, converted.params, pixels.permute(0, 2, 3, 1).numpy(), request)


def _timm_outputs(model, pixels: torch.Tensor) -> dict:
    with torch.no_grad():
        tokens = model.forward_features(pixels)
        raw_last = model.forward_intermediates(
            pixels, indices=[len(model.blocks) - 1], intermediates_only=True, output_fmt="NLC"
        )[0]
        return {
            "pooled": model.forward_head(tokens, pre_logits=True).numpy(),
            "patches": tokens[:, model.num_prefix_tokens :].numpy(),
            "raw_patches": raw_last.numpy(),
            "logits": model.forward_head(tokens).numpy(),
        }


def _assert_parity(converted, peer: dict, pixels: torch.Tensor, logits: bool = True) -> None:
    """Pooled feature, the last layer's normed patch tokens, logits and, where the peer gives
    them, the last block's raw patch tokens, all within TOL of the peer's."""
    ours = _ours(converted, pixels, EVERYTHING if logits else FEATURES)
    last = converted.config.depth - 1
    assert rel_err(ours["pooled"], peer["pooled"]) < TOL
    assert rel_err(ours["patch_tokens"][last], peer["patches"]) < TOL
    if logits:
        assert rel_err(ours["logits"], peer["logits"]) < TOL
    if "raw_patches" in peer:  # un-normed tokens of the last block (timm forward_intermediates)
        raw = _ours(converted, pixels, OutputRequest(pooled=False, patch_layers=(-1,)))
        assert rel_err(raw["patch_tokens"][last], peer["raw_patches"]) < TOL


def test_timm_runs_its_own_modules_without_torchvision():
    import importlib.util

    import timm.data.transforms
    import timm.layers.norm_act

    if uses_stand_in():
        # the stand-in lived only while timm imported; what timm kept of it refuses to run
        assert importlib.util.find_spec("torchvision") is None
        with pytest.raises(RuntimeError, match="stand-in"):
            timm.layers.norm_act.FrozenBatchNorm2d(4)
        with pytest.raises(RuntimeError, match="stand-in"):
            timm.data.transforms.MaybeToTensor()
    model = timm.create_model("vit_base_patch16_xp_224", pretrained=False, **TINY)
    assert isinstance(model.blocks[0], ParallelScalingBlock)
    assert model(_pixels()).shape == (2, 1000)


# ------------------------------------------------------------------------------------------
# timm
# ------------------------------------------------------------------------------------------

TIMM_CASES = {
    # standard ViT (Block): fused qkv with bias, CLS token, classifier; heads from timm's config
    "vit": ("vit_base_patch16_224", dict(num_classes=5), "config"),
    # LayerScale folded into the out-projections, no qkv bias, a .pth file
    "vit-layerscale": (
        "vit_base_patch16_224",
        dict(num_classes=0, init_values=1e-5, qkv_bias=False),
        "pth",
    ),
    # ViT-22B-style *_xp_*: ParallelScalingBlock, in_proj mlp|q|k|v, RmsNorm, QK-norm, norm_pre
    "xp": ("vit_base_patch16_xp_224", dict(num_classes=7), "safetensors"),
    # the same with in_proj bias (mlp bias inside it) and one fused out-projection
    "xp-fused": (
        "vit_base_patch16_xp_224",
        dict(
            qkv_bias=True,
            init_values=1e-5,
            block_fn=partial(ParallelScalingBlock, fuse_out_proj=True),
        ),
        "safetensors",
    ),
    # timm's fc_norm: average pooling, the final norm on the pooled feature, the tokens un-normed
    # (the SBB *_gap_* ViTs: registers, no class token)
    "gap-fc-norm": (
        "vit_base_patch16_224",
        dict(class_token=False, reg_tokens=2, no_embed_class=True, global_pool="avg"),
        "config",
    ),
    # with a class token (EVA-L's layout), a bare state dict: fc_norm itself says average pooling
    "cls-gap-fc-norm": ("vit_base_patch16_224", dict(global_pool="avg", fc_norm=True), "pth"),
    # fc_norm asked for beside class-token pooling: the norm on the class token alone
    "cls-fc-norm": ("vit_base_patch16_224", dict(fc_norm=True), "config"),
    # and after attention pooling
    "map-fc-norm": ("vit_base_patch16_224", dict(class_token=False, global_pool="map",
                                                 fc_norm=True), "config"),
    # the paper's head: no class token, multi-head attention pooling
    "xp-map": (
        "vit_base_patch16_xp_224",
        dict(class_token=False, global_pool="map"),
        "safetensors",
    ),
}


def _export_timm(model, folder, how: str) -> str:
    folder.mkdir(exist_ok=True)
    if how == "pth":
        torch.save(model.state_dict(), folder / "model.pth")
        return str(folder / "model.pth")
    save_file(model.state_dict(), str(folder / "model.safetensors"))
    if how == "config":
        save_config_for_hf(model, str(folder / "config.json"))
        return str(folder)
    return str(folder / "model.safetensors")


@pytest.mark.parametrize("case", list(TIMM_CASES))
def test_timm_parity(case, tmp_path):
    name, kwargs, how = TIMM_CASES[case]
    model = timm.create_model(name, pretrained=False, **{**TINY, **kwargs}).eval()
    perturb(model, seed=1)
    source = _export_timm(model, tmp_path / case, how)
    heads = None if how == "config" or "xp" in case else 4  # QK-norm or config.json tell
    converted = convert("timm", source, Hints(heads=heads))
    cfg = converted.config
    assert cfg.block == ("parallel" if "xp" in case else "sequential")
    assert cfg.heads == 4 and cfg.width == 64 and cfg.depth == 2 and cfg.image_size == 32
    assert cfg.num_classes == model.num_classes
    assert cfg.pool_norm == ("fc-norm" in case)
    pixels = _pixels()
    _assert_parity(converted, _timm_outputs(model, pixels), pixels, logits=model.num_classes > 0)
    if how == "config":
        assert converted.source == "timm:vit_base_patch16_224"
        assert cfg.preprocess.resize == 35 and cfg.preprocess.interpolation == "bicubic"


def test_timm_parallel_model_converts_into_the_default_preset(tmp_path):
    """A timm ParallelScalingBlock model with vit-22b-tiny/16's shape *is* that preset."""
    preset = get_config("vit-22b-tiny/16")
    model = timm.create_model(
        "vit_base_patch16_xp_224",
        pretrained=False,
        img_size=64,
        patch_size=16,
        embed_dim=64,
        depth=4,
        num_heads=4,
        num_classes=0,
        class_token=False,
        global_pool="map",
        pre_norm=False,
    ).eval()
    perturb(model, seed=4)
    save_file(model.state_dict(), str(tmp_path / "w.safetensors"))
    out = tmp_path / "ckpt"
    args = ["convert", "--from", "timm", "--input", str(tmp_path / "w.safetensors")]
    assert main([*args, "--model", preset.name, "--out", str(out)]) == 0
    meta = ckpt.read_metadata(out)
    assert meta.config == preset
    assert meta.source == "timm:w"

    # restored onto a (2, 4) mesh, the checkpoint gives timm's features
    mesh = make_mesh("data=2,model=4")
    cfg, params, _ = ckpt.restore(out, mesh, expect=preset)
    cfg = cfg.replace(compute_dtype="float32")
    pixels = _pixels(8, 64)
    forward = jax.jit(
        lambda p, x: apply(cfg, p, x, FEATURES),
        in_shardings=(param_shardings(cfg, mesh), batch_sharding(mesh)),
    )
    ours = forward(params, pixels.permute(0, 2, 3, 1).numpy())
    peer = _timm_outputs(model, pixels)
    assert rel_err(ours["pooled"], peer["pooled"]) < TOL
    assert rel_err(ours["patch_tokens"][3], peer["patches"]) < TOL


# ------------------------------------------------------------------------------------------
# Hugging Face
# ------------------------------------------------------------------------------------------


def _hf_model(cls_name: str, model_kwargs: dict | None = None, **kw):
    import transformers

    config = transformers.ViTConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        image_size=32,
        patch_size=8,
        **kw,
    )
    model = getattr(transformers, cls_name)(config, **(model_kwargs or {})).eval()
    perturb(model, seed=2)
    return model


def test_hf_vit_model_parity_from_save_pretrained(tmp_path):
    model = _hf_model("ViTModel")
    model.save_pretrained(tmp_path / "hf")
    converted = convert("hf", tmp_path / "hf")
    assert converted.config.norm_eps == 1e-12 and converted.config.heads == 4
    assert any("dropped pooler.dense.weight" in note for note in converted.notes)
    pixels = _pixels()
    with torch.no_grad():
        out = model(pixel_values=pixels, output_hidden_states=True)
    peer = {
        "pooled": out.last_hidden_state[:, 0].numpy(),  # what ViTForImageClassification reads
        "patches": out.last_hidden_state[:, 1:].numpy(),
        "raw_patches": out.hidden_states[-1][:, 1:].numpy(),
    }
    _assert_parity(converted, peer, pixels, logits=False)


def test_hf_classifier_is_kept_with_a_head_file(tmp_path, capsys):
    model = _hf_model("ViTForImageClassification", num_labels=6)
    model.save_pretrained(tmp_path / "hf")
    out = tmp_path / "ckpt"
    assert (
        main(["convert", "--from", "hf", "--input", str(tmp_path / "hf"), "--out", str(out)]) == 0
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["num_classes"] == 6 and summary["source"] == "hf:hf"
    cfg, params, meta = ckpt.restore(out, make_mesh("data=2,model=4"), verify=True)
    head = np.load(out / "head.npz")
    assert head["kernel"].shape == (64, 6) and head["bias"].shape == (6,)
    np.testing.assert_array_equal(head["kernel"], model.classifier.weight.detach().numpy().T)
    converted = convert("hf", tmp_path / "hf")
    pixels = _pixels()
    with torch.no_grad():
        out_hf = model.vit(pixel_values=pixels)
        logits = model(pixel_values=pixels).logits
    peer = {
        "pooled": out_hf.last_hidden_state[:, 0].numpy(),
        "patches": out_hf.last_hidden_state[:, 1:].numpy(),
        "logits": logits.numpy(),
    }
    _assert_parity(converted, peer, pixels)


def test_hf_state_dict_without_config_needs_heads(tmp_path):
    """transformers 5 names modules differently in memory (layers.N.attention.q_proj ...)."""
    model = _hf_model("ViTModel", {"add_pooling_layer": False})
    save_file(model.state_dict(), str(tmp_path / "sd.safetensors"))
    assert any(k.startswith("layers.0.attention.q_proj") for k in model.state_dict())
    with pytest.raises(ConvertError, match="pass --heads N"):
        convert("hf", tmp_path / "sd.safetensors")
    converted = convert("hf", tmp_path / "sd.safetensors", Hints(heads=4))
    assert any("LayerNorm epsilon 1e-12" in note for note in converted.notes)
    pixels = _pixels()
    with torch.no_grad():
        hidden = model(pixel_values=pixels).last_hidden_state
    peer = {"pooled": hidden[:, 0].numpy(), "patches": hidden[:, 1:].numpy()}
    _assert_parity(converted, peer, pixels, logits=False)


# ------------------------------------------------------------------------------------------
# big_vision
# ------------------------------------------------------------------------------------------

D, H, HD, M, P, C, DEPTH, N, CLASSES = 64, 4, 16, 128, 8, 3, 2, 16, 5


def _big_vision_npz(
    pool: str, seed: int = 0, d=D, h=H, m=M, p=P, depth=DEPTH, n=N, classes=CLASSES
) -> dict[str, np.ndarray]:
    """Random weights under big_vision models/vit.py's parameter names."""
    rng = np.random.default_rng(seed)

    def r(*shape, centre=0.0):
        return (centre + 0.1 * rng.standard_normal(shape)).astype(np.float32)

    def attention(prefix: str) -> dict:
        w = {f"{prefix}{n}/kernel": r(d, h, (d // h)) for n in ("query", "key", "value")}
        w |= {f"{prefix}{n}/bias": r(h, (d // h)) for n in ("query", "key", "value")}
        return w | {f"{prefix}out/kernel": r(h, (d // h), d), f"{prefix}out/bias": r(d)}

    def mlp(prefix: str) -> dict:
        return {
            f"{prefix}Dense_0/kernel": r(d, m),
            f"{prefix}Dense_0/bias": r(m),
            f"{prefix}Dense_1/kernel": r(m, d),
            f"{prefix}Dense_1/bias": r(d),
        }

    def norm(prefix: str) -> dict:
        return {f"{prefix}scale": r(d, centre=1.0), f"{prefix}bias": r(d)}

    w = {"embedding/kernel": r(p, p, C, d), "embedding/bias": r(d), "pos_embedding": r(1, n, d)}
    w |= norm("Transformer/encoder_norm/")
    if classes:
        w |= {"head/kernel": r(d, classes), "head/bias": r(classes)}
    if pool == "tok":
        w["cls"] = r(1, 1, d)
    for i in range(depth):
        b = f"Transformer/encoderblock_{i}/"
        w |= norm(b + "LayerNorm_0/") | norm(b + "LayerNorm_1/")
        w |= attention(b + "MultiHeadDotProductAttention_0/") | mlp(b + "MlpBlock_0/")
    if pool == "map":
        w |= {"MAPHead_0/probe": r(1, 1, d)} | attention(
            "MAPHead_0/MultiHeadDotProductAttention_0/"
        )
        w |= norm("MAPHead_0/LayerNorm_0/") | mlp("MAPHead_0/MlpBlock_0/")
    return w


# big_vision's pooling types as timm builds them (its loader reads big_vision's names)
BIG_VISION_TIMM = {
    "tok": dict(class_token=True, no_embed_class=True, global_pool="token"),
    "map": dict(class_token=False, global_pool="map"),
    "gap": dict(class_token=False, global_pool="avg", fc_norm=False),
}


@pytest.mark.parametrize("pool", list(BIG_VISION_TIMM))
def test_big_vision_parity_through_timms_loader(pool, tmp_path):
    path = tmp_path / f"{pool}.npz"
    np.savez(path, **_big_vision_npz(pool))
    model = VisionTransformer(
        img_size=32,
        patch_size=P,
        embed_dim=D,
        depth=DEPTH,
        num_heads=H,
        mlp_ratio=M / D,
        num_classes=CLASSES,
        act_layer="gelu_tanh",  # flax's nn.gelu
        **BIG_VISION_TIMM[pool],
    ).eval()
    model.load_pretrained(str(path))  # timm's own reader of big_vision checkpoints
    converted = convert("big_vision", path)
    cfg = converted.config
    assert not cfg.posemb_covers_cls and not cfg.gelu_exact
    assert cfg.head == {"tok": "cls", "map": "map", "gap": "gap"}[pool]
    # big_vision's pool_type '0' leaves a 'gap' model's weights: the guess is said
    assert any("read as the average of the patch tokens" in note
               for note in converted.notes) == (pool == "gap")
    pixels = _pixels()
    _assert_parity(converted, _timm_outputs(model, pixels), pixels)


def test_vision_transformer_layout_parity_through_timms_loader(tmp_path):
    """google-research/vision_transformer's .npz (the original ViT and AugReg files): blocks
    with MultiHeadDotProductAttention_1, LayerNorm_2 and MlpBlock_3, and a position table at
    Transformer/posembed_input covering the class token. Refused before ("missing key
    ...MultiHeadDotProductAttention_0/query/kernel"); timm's loader reads it as the peer."""
    bv = _big_vision_npz("tok", seed=8)
    renames = (("MultiHeadDotProductAttention_0/", "MultiHeadDotProductAttention_1/"),
               ("LayerNorm_1/", "LayerNorm_2/"), ("MlpBlock_0/", "MlpBlock_3/"))
    vit_jax = {}
    for key, value in bv.items():
        for old, new in renames if key.startswith("Transformer/encoderblock_") else ():
            key = key.replace(old, new)
        vit_jax[key] = value
    table = vit_jax.pop("pos_embedding")
    row = np.random.default_rng(9).standard_normal((1, 1, D)).astype(np.float32) * 0.1
    vit_jax["Transformer/posembed_input/pos_embedding"] = np.concatenate([row, table], axis=1)
    path = tmp_path / "ViT-Ti_8-augreg.npz"
    np.savez(path, **vit_jax)
    model = VisionTransformer(img_size=32, patch_size=P, embed_dim=D, depth=DEPTH, num_heads=H,
                              mlp_ratio=M / D, num_classes=CLASSES, act_layer="gelu_tanh").eval()
    model.load_pretrained(str(path))
    converted = convert("big_vision", path)
    cfg = converted.config
    assert cfg.posemb_covers_cls and cfg.head == "cls" and cfg.image_size == 32
    assert any("vision_transformer's layout" in note for note in converted.notes)
    pixels = _pixels()
    _assert_parity(converted, _timm_outputs(model, pixels), pixels)
    # big_vision's name beside one it would be renamed to: one silently won (86% off)
    stray = {**vit_jax, "Transformer/encoderblock_0/LayerNorm_1/scale": np.ones(D, np.float32)}
    np.savez(tmp_path / "both.npz", **stray)
    with pytest.raises(ConvertError, match="'Transformer/encoderblock_0/LayerNorm_2/scale' "
                                           "beside 'Transformer/encoderblock_0/LayerNorm_1/scale'"):
        convert("big_vision", tmp_path / "both.npz")
    # a class token and a table without its row: that code could not run it (read as
    # big_vision's table, it converted without a word)
    np.savez(tmp_path / "short.npz", **{**vit_jax, "Transformer/posembed_input/pos_embedding":
                                         table})
    with pytest.raises(ConvertError, match="with a class token, but its position table of 16 "
                                           "rows has none for it"):
        convert("big_vision", tmp_path / "short.npz")


def test_big_vision_siglip_image_tower_parity(tmp_path):
    """A SigLIP two-tower .npz: params/img/ (MAPHead, no classifier) beside params/txt/, t, b;
    timm's loader reads the image tower as the peer."""
    sizes = dict(d=40, h=4, m=72, p=4, depth=2, n=9, classes=0)  # 12x12 images, head_dim 10
    img = _big_vision_npz("map", seed=6, **sizes)
    rng = np.random.default_rng(7)
    text = {"params/txt/Embed_0/embedding": rng.standard_normal((10, 16)).astype(np.float32)}
    text |= {"params/t": np.ones(1, np.float32), "params/b": np.zeros(1, np.float32)}
    path = tmp_path / "siglip.npz"
    np.savez(path, **{f"params/img/{k}": v for k, v in img.items()}, **text)
    model = VisionTransformer(
        img_size=12,
        patch_size=4,
        embed_dim=40,
        depth=2,
        num_heads=4,
        mlp_ratio=72 / 40,
        num_classes=0,
        act_layer="gelu_tanh",
        class_token=False,
        global_pool="map",
    ).eval()
    model.load_pretrained(str(path))
    converted = convert("big_vision", path)
    assert converted.config.head == "map" and converted.config.image_size == 12
    assert any("dropped the text tower" in note for note in converted.notes)
    pixels = _pixels(2, 12)
    peer = _timm_outputs(model, pixels)
    peer = {"pooled": peer["pooled"], "patch_tokens": peer["patches"]}
    check_parity(
        "big_vision-siglip", "big_vision SigLIP .npz", converted, pixels.numpy(), peer, True
    )


def test_big_vision_scanned_and_prefixed_layouts_convert_alike(tmp_path):
    flat = _big_vision_npz("map", seed=3)
    np.savez(tmp_path / "flat.npz", **flat)
    scanned = {k: v for k, v in flat.items() if not k.startswith("Transformer/encoderblock_")}
    for key in [k for k in flat if k.startswith("Transformer/encoderblock_0/")]:
        rest = key.removeprefix("Transformer/encoderblock_0/")
        stack = [flat[f"Transformer/encoderblock_{i}/{rest}"] for i in range(DEPTH)]
        scanned[f"Transformer/encoderblock/{rest}"] = np.stack(stack)
    np.savez(tmp_path / "scanned.npz", **{f"params/{k}": v for k, v in scanned.items()})
    a = convert("big_vision", tmp_path / "flat.npz")
    b = convert("big_vision", tmp_path / "scanned.npz")
    assert a.config.replace(name="x") == b.config.replace(name="x")
    assert ckpt.fingerprint(a.params) == ckpt.fingerprint(b.params)


# ------------------------------------------------------------------------------------------
# refusals: every key accounted for, by name
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def timm_state():
    model = timm.create_model("vit_base_patch16_xp_224", pretrained=False, **TINY)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _convert_state(state, tmp_path, **hints):
    save_file(state, str(tmp_path / "s.safetensors"))
    return convert("timm", tmp_path / "s.safetensors", Hints(**hints))


def _convert_with_config(model, tmp_path, architecture: str, **model_args):
    """``model``'s weights beside a timm config.json naming ``architecture`` and ``model_args``."""
    folder = tmp_path / architecture
    folder.mkdir()
    save_file(model.state_dict(), str(folder / "model.safetensors"))
    config = {"architecture": architecture, "num_classes": model.num_classes,
              "model_args": {"num_heads": TINY["num_heads"], **model_args}}
    (folder / "config.json").write_text(json.dumps(config))
    return convert("timm", folder)


def test_timm_models_that_compute_otherwise_are_refused_not_misread(tmp_path):
    """Weights laid out as a VisionTransformer's whose code computes something else: what
    config.json says of the architecture and the MLP decides, and a bare file's guesses are
    named in the notes."""
    from timm.layers import SwiGLU, SwiGLUPacked

    post_norm = timm.create_model("vit_base_patch16_rpn_224", pretrained=False,
                                  **{**TINY, "img_size": 32}, fc_norm=False)
    with pytest.raises(ConvertError, match=r"post-norm residual blocks \(ResPostBlock\)"):
        _convert_with_config(post_norm, tmp_path, "vit_base_patch16_rpn_224")
    plain = timm.create_model("vit_base_patch16_224", pretrained=False, **TINY)
    with pytest.raises(ConvertError, match="timm's Eva models"):  # rotary: no weights show it
        _convert_with_config(plain, tmp_path, "vit_base_patch16_rope_reg1_gap_256")
    # eva.py's DINOv3 port is read (tests/test_backbones.py); a plain ViT's weights under its
    # name are not: their table has no place beside the rotary embedding
    with pytest.raises(ConvertError, match="an absolute position table beside the rotary"):
        _convert_with_config(plain, tmp_path, "vit_large_patch16_dinov3_qkvb")
    # test_vit3's registration pools over its register too (pool_include_prefix), which a hub
    # config.json does not record: converted, its pooled output was 8% off (convert_fuzz.py)
    prefixed = timm.create_model("test_vit3", pretrained=False, **TINY, num_classes=0)
    with pytest.raises(ConvertError, match=r"pool_include_prefix=True \(the pooling reads the "
                                           r"class and register tokens too\)"):
        _convert_with_config(prefixed, tmp_path, "test_vit3")
    # vision_transformer.py's own eva_large_* are plain ViTs (were refused as rotary)
    assert _convert_with_config(plain, tmp_path, "eva_large_patch14_196").config.heads == 4
    branches = timm.create_model("vit_small_patch16_18x2_224", pretrained=False, **TINY)
    with pytest.raises(ConvertError, match=r"parallel attention and MLP branches \(timm "
                                           "ParallelThingsBlock"):  # was: not a ViT
        _convert_with_config(branches, tmp_path, "vit_small_patch16_18x2_224")
    packed = timm.create_model("vit_base_patch16_224", pretrained=False, **TINY,
                               mlp_layer=SwiGLUPacked, mlp_ratio=4)
    with pytest.raises(ConvertError, match="a gated MLP with act_layer='gelu'"):
        _convert_with_config(packed, tmp_path, "vit_a", act_layer="gelu")
    with pytest.raises(ConvertError, match="mlp_layer='GluMlp' is not supported"):
        _convert_with_config(packed, tmp_path, "vit_b", mlp_layer="GluMlp")
    bare = _convert_state(packed.state_dict(), tmp_path, heads=4)
    assert any("gated MLP read as SwiGLU" in note for note in bare.notes)
    apart = timm.create_model("vit_base_patch16_224", pretrained=False, **TINY, mlp_layer=SwiGLU)
    with pytest.raises(ConvertError, match="a SwiGLU MLP with its gate and value apart"):
        _convert_state(apart.state_dict(), tmp_path, heads=4)
    no_norm = timm.create_model("vit_base_patch16_224", pretrained=False, **TINY,
                                final_norm=False)
    with pytest.raises(ConvertError, match=r"no final norm \('norm.weight'\)"):
        _convert_state(no_norm.state_dict(), tmp_path, heads=4)
    averaged = timm.create_model("vit_base_patch16_224", pretrained=False, **TINY,
                                 class_token=False, global_pool="avg", fc_norm=False)
    notes = _convert_state(averaged.state_dict(), tmp_path, heads=4).notes
    assert any("read as the average of the patch tokens" in note for note in notes)
    assert any("read as a square 4x4 grid" in note for note in notes)


def test_timm_architectures_own_activation_and_epsilon_are_read_by_name():
    """What timm's registrations pass VisionTransformer themselves is not in a hub config.json:
    the converter reads the MLP's activation and the norms' epsilon of every registered
    architecture by its name, as timm builds it (SigLIP 2's tanh GELU was read as exact)."""
    from timm.layers import GELUTanh, QuickGELU
    from vit22b.model.convert_common import SourceTensors
    from vit22b.model.convert_timm import _norm_eps, _own_args

    built_as = {GELUTanh: "gelu_tanh", QuickGELU: "quick_gelu", torch.nn.GELU: "gelu"}
    for name in timm.list_models(module="vision_transformer"):
        with torch.device("meta"):  # the architecture's own modules, no memory
            model = timm.create_model(name, pretrained=False, img_size=16, patch_size=4,
                                      embed_dim=32, depth=1, num_heads=2)
        modules = list(model.modules())
        if any(isinstance(m, torch.nn.SiLU) for m in modules):
            continue  # a gated MLP: refused, or read as SwiGLU
        acts = {next(act for kind, act in built_as.items() if isinstance(m, kind))
                for m in modules if isinstance(m, tuple(built_as))}
        assert acts == {_own_args(name).get("act_layer", "gelu")}, name
        mapped = ("norm", "norm1", "norm2", "in_norm", "norm_pre", "q_norm", "k_norm")
        eps = {m.eps for path, m in model.named_modules() if path.split(".")[-1] in mapped
               and isinstance(m, torch.nn.LayerNorm | timm.layers.RmsNorm)}
        assert eps <= {_norm_eps({"architecture": name}, SourceTensors({}, "timm"))}, name


def test_missing_unexpected_and_misshaped_keys_are_named(timm_state, tmp_path):
    state = dict(timm_state)
    del state["blocks.1.attn_out_proj.weight"]
    state["blocks.0.extra.weight"] = torch.zeros(3)
    state["blocks.1.mlp_bias"] = torch.zeros(255)
    with pytest.raises(ConvertError) as err:
        _convert_state(state, tmp_path)
    message = str(err.value)
    assert "missing key 'blocks.1.attn_out_proj.weight' (expected shape (64, 64))" in message
    assert "unexpected key 'blocks.0.extra.weight' with shape (3,)" in message
    assert "key 'blocks.1.mlp_bias' has shape (255,), expected (256,)" in message


def test_weights_that_are_not_finite_are_named(timm_state, tmp_path):
    """A NaN or an infinity in any weight (a corrupt download) would make every served output
    NaN: the conversion refuses, naming each tensor and its count."""
    state = dict(timm_state)
    state["blocks.0.in_proj.weight"] = state["blocks.0.in_proj.weight"].clone()
    state["blocks.0.in_proj.weight"][0, :3] = float("nan")
    state["blocks.1.q_norm.weight"] = state["blocks.1.q_norm.weight"].clone()
    state["blocks.1.q_norm.weight"][5] = float("-inf")
    with pytest.raises(ConvertError) as err:
        _convert_state(state, tmp_path)
    message = str(err.value)
    assert "key 'blocks.0.in_proj.weight' holds 3 NaN and 0 infinite values of 28672" in message
    assert "key 'blocks.1.q_norm.weight' holds 0 NaN and 1 infinite values of 16" in message
    state = dict(timm_state)  # complex weights: a float32 cast would drop the imaginary parts
    state["norm_pre.weight"] = state["norm_pre.weight"].to(torch.complex64)
    torch.save(state, tmp_path / "complex.pth")
    with pytest.raises(ConvertError, match=r"key 'norm_pre.weight' holds complex values "
                                           r"\(complex64\)"):
        convert("timm", tmp_path / "complex.pth", Hints())


@pytest.mark.parametrize(
    "key, shape, what",
    [
        # timm's fc_norm is taken in place of the tokens' norm, not beside it
        ("norm.weight", (64,), "a norm on the tokens and another after pooling"),
        # DeiT's distillation token is read as a register: not beside registers of its own
        ("dist_token", (1, 1, 64), "a distillation token beside register tokens"),
    ],
)
def test_keys_the_model_cannot_express_are_refused_not_dropped(
    timm_state, tmp_path, key, shape, what
):
    state = dict(timm_state) | {key: torch.zeros(shape)}
    if key == "norm.weight":
        state["fc_norm.weight"] = torch.zeros(shape)
    if key == "dist_token":
        state["reg_token"] = torch.zeros(1, 2, shape[-1])
    with pytest.raises(ConvertError, match=re.escape(f"key {key!r} {tuple(shape)} is {what}")):
        _convert_state(state, tmp_path)


def test_weight_files_larger_than_the_hosts_memory_are_refused_before_any_read(tmp_path, capsys):
    """Every reader holds a checkpoint's tensors whole. Tensors each smaller than the memory
    available but larger together (three of 1 GiB under a 2 GiB cgroup limit) were read on
    past it: allocations succeed (Linux overcommits), and the process thrashed or was killed.
    Refused now, before any read, naming both sizes. The file is sparse: a hostile tester's
    cheap checkpoint, nothing on disk."""
    have = available_memory()
    if have is None or have > 1 << 40:
        pytest.skip(f"{have} bytes available: no sparse file of that size here")
    count, header, end = have // 8, {}, 0  # three tensors of half the room each
    for name in ("a", "b", "c"):
        header[name] = {"dtype": "F32", "shape": [count], "data_offsets": [end, end + 4 * count]}
        end += 4 * count
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + end)  # a hole
    out = tmp_path / "o"
    assert main(["convert", "--from", "timm", "--input", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(
        rf"vit22b convert: {re.escape(str(path))}: its weight files take "
        rf"{path.stat().st_size / 2**30:.1f} GiB, read whole, and [\d.]+ GiB of memory is "
        r"available: converting it needs a host with more memory", err), err
    assert not out.exists()


def test_heads_must_come_from_somewhere(tmp_path):
    model = timm.create_model("vit_base_patch16_224", pretrained=False, **TINY)
    with pytest.raises(ConvertError, match=r"number of heads is not in the weights .* --heads N"):
        _convert_state(model.state_dict(), tmp_path)
    assert _convert_state(model.state_dict(), tmp_path, heads=2).config.heads == 2


def test_a_preset_that_does_not_match_is_refused_by_parameter(timm_state, tmp_path, capsys):
    save_file(timm_state, str(tmp_path / "s.safetensors"))
    args = ["convert", "--from", "timm", "--input", str(tmp_path / "s.safetensors")]
    assert main([*args, "--model", "vit-22b-tiny/16", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "the checkpoint is not a vit-22b-tiny/16" in err
    assert (
        "parameter patch_embed: the checkpoint has shape (192, 64), "
        "preset vit-22b-tiny/16 expects (768, 64)"
    ) in err
    assert not (tmp_path / "o").exists()
    assert (
        main([*args[:-1], str(tmp_path / "absent.safetensors"), "--out", str(tmp_path / "o")]) == 2
    )
    assert "no such file or directory" in capsys.readouterr().err
    os.mkfifo(tmp_path / "pipe.safetensors")  # there, but no file: not "no such file"
    assert main([*args[:-1], str(tmp_path / "pipe.safetensors"), "--out", str(tmp_path / "o")]) == 2
    assert (f"{tmp_path / 'pipe.safetensors'}: not a regular file or a folder"
            in capsys.readouterr().err)


def test_bfloat16_weights_stay_bfloat16_unless_asked(tmp_path):
    model = timm.create_model("vit_base_patch16_xp_224", pretrained=False, **TINY).eval()
    perturb(model, seed=5)
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    torch.save(state, tmp_path / "bf16.pth")
    converted = convert("timm", tmp_path / "bf16.pth")
    assert converted.config.param_dtype == "bfloat16"
    w_in = converted.params["block_0"]["w_in"]
    assert w_in.dtype.name == "bfloat16"
    # bit-exact regrouping: the in_proj's q rows are w_in's first head_dim columns, per head
    q_rows = state["blocks.0.in_proj.weight"][256 : 256 + 64].float().numpy()  # after the MLP
    np.testing.assert_array_equal(w_in[:, :, :16].astype(np.float32).reshape(64, 64), q_rows.T)
    as_f32 = convert("timm", tmp_path / "bf16.pth", Hints(dtype="float32"))
    assert as_f32.params["block_0"]["w_in"].dtype == np.float32
