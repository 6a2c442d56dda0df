"""The frozen-feature backbones people use, each built with its source's own code (transformers,
timm, open_clip) at a tiny shape no other test uses, perturbed so every parameter matters,
written in the source's file format, converted without --model and run in float32 compute:
pooled, last-layer patch and register tokens equal the source's forward to 1e-5 relative
(tests/parity.py; bf16 measured)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from parity import TOL_F32, check_parity, our_outputs
from peers import import_open_clip, import_timm, perturb, rel_err, vit_layout_outputs
from safetensors.torch import save_file
from vit22b.model import OutputRequest
from vit22b.model.convert import ConvertError, Hints, convert

timm = import_timm()
from timm.models._hub import save_config_for_hf  # noqa: E402

# width 48, 4 heads of 12 (RoPE needs head_dim % 4 == 0), 2 blocks, 4x4 patches of 4 pixels
SHAPE = dict(
    hidden_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4
)


def _pixels(n: int = 2, size: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------
# Hugging Face transformers
# ------------------------------------------------------------------------------------------


def _hf(cls_name: str, config_name: str, seed: int, **kw):
    import transformers

    config = getattr(transformers, config_name)(**SHAPE, **kw)
    model = getattr(transformers, cls_name)(config).eval()
    perturb(model, seed=seed)
    return model


def _dino_outputs(model, pixels) -> dict:
    """DINOv2 / DINOv3: pooler_output is the normed class token; then registers, then patches."""
    out = model(pixel_values=pixels)
    registers = getattr(model.config, "num_register_tokens", 0)
    peer = {
        "pooled": out.pooler_output,
        "patch_tokens": out.last_hidden_state[:, 1 + registers :],
    }
    if registers:
        peer["register_tokens"] = out.last_hidden_state[:, 1 : 1 + registers]
    return peer


def _clip_outputs(model, pixels) -> dict:
    """CLIP: last_hidden_state is before post_layernorm; image_embeds is the projected pooled."""
    out = model(pixel_values=pixels)
    if hasattr(out, "image_embeds"):
        inner = model.vision_model(pixel_values=pixels)
        return {
            "pooled": out.image_embeds,
            "pre_projection": inner.pooler_output,
            "patch_tokens": out.last_hidden_state[:, 1:],
        }
    return {"pooled": out.pooler_output, "patch_tokens": out.last_hidden_state[:, 1:]}


def _siglip_outputs(model, pixels) -> dict:
    out = model(pixel_values=pixels)
    return {"pooled": out.pooler_output, "patch_tokens": out.last_hidden_state}


# case: (model class, config class, config kwargs, outputs, patches normed, what must be inferred)
HF_CASES = {
    "dinov2": ("Dinov2Model", "Dinov2Config", {}, _dino_outputs, True, {"num_registers": 0}),
    "dinov2-swiglu": (
        "Dinov2Model",
        "Dinov2Config",
        dict(use_swiglu_ffn=True),
        _dino_outputs,
        True,
        {"mlp": "swiglu", "mlp_dim": 128},  # 2/3 of 4 x 48, rounded up to a multiple of 8
    ),
    "dinov2-registers": (
        "Dinov2WithRegistersModel",
        "Dinov2WithRegistersConfig",
        dict(num_register_tokens=3),
        _dino_outputs,
        True,
        {"num_registers": 3, "posemb_covers_cls": True},
    ),
    "dinov3": (
        "DINOv3ViTModel",
        "DINOv3ViTConfig",
        dict(intermediate_size=96, num_register_tokens=2, rope_theta=50.0),
        _dino_outputs,
        True,
        {"num_registers": 2, "posemb": "rope", "rope_theta": 50.0, "norm_eps": 1e-5},
    ),
    # a value bias without a query bias: the missing projections' biases are zeros
    "dinov3-no-query-bias": (
        "DINOv3ViTModel",
        "DINOv3ViTConfig",
        dict(intermediate_size=96, num_register_tokens=1, query_bias=False),
        _dino_outputs,
        True,
        {"qkv_bias": True, "num_registers": 1},
    ),
    "dinov3-gated": (
        "DINOv3ViTModel",
        "DINOv3ViTConfig",
        dict(intermediate_size=80, num_register_tokens=1, use_gated_mlp=True, hidden_act="silu"),
        _dino_outputs,
        True,
        {"mlp": "swiglu", "mlp_dim": 80},
    ),
    "vit-msn": (
        "ViTMSNModel",
        "ViTMSNConfig",
        dict(intermediate_size=96),
        vit_layout_outputs,
        True,
        {"norm_eps": 1e-6, "class_token": True, "posemb_covers_cls": True},
    ),
    "vit-mae": (
        "ViTMAEModel",
        "ViTMAEConfig",
        dict(intermediate_size=96, mask_ratio=0.0),
        vit_layout_outputs,
        True,
        {"norm_eps": 1e-12, "class_token": True, "posemb_covers_cls": True},
    ),
    "ijepa": (
        "IJepaModel",
        "IJepaConfig",
        dict(intermediate_size=96),
        vit_layout_outputs,
        True,
        {"class_token": False, "head": "gap", "posemb_covers_cls": False},
    ),
    "deit": (
        "DeiTModel",
        "DeiTConfig",
        dict(intermediate_size=96),
        vit_layout_outputs,
        True,
        {"num_registers": 1, "posemb_covers_cls": True, "posemb_covers_registers": True},
    ),
    "clip": (
        "CLIPVisionModel",
        "CLIPVisionConfig",
        dict(intermediate_size=96),
        _clip_outputs,
        False,
        {"mlp": "quick_gelu", "pre_norm": True, "projection_dim": 0},
    ),
    "clip-projection": (
        "CLIPVisionModelWithProjection",
        "CLIPVisionConfig",
        dict(intermediate_size=96, projection_dim=24),
        _clip_outputs,
        False,
        {"mlp": "quick_gelu", "projection_dim": 24},
    ),
    "siglip": (
        "SiglipVisionModel",
        "SiglipVisionConfig",
        dict(intermediate_size=96),
        _siglip_outputs,
        True,
        {"head": "map", "gelu_exact": False, "class_token": False},
    ),
    # the pooling head's MLP takes the model's activation too (transformers' hidden_act)
    "siglip-quick-gelu": (
        "SiglipVisionModel",
        "SiglipVisionConfig",
        dict(intermediate_size=96, hidden_act="quick_gelu"),
        _siglip_outputs,
        True,
        {"head": "map", "mlp": "quick_gelu"},
    ),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_parity(case, tmp_path):
    cls_name, config_name, kw, outputs, normed, expected = HF_CASES[case]
    model = _hf(cls_name, config_name, seed=11 + len(case), **kw)
    model.save_pretrained(tmp_path / case)
    converted = convert("hf", tmp_path / case)
    cfg = converted.config
    assert (cfg.width, cfg.depth, cfg.heads, cfg.patch, cfg.image_size) == (48, 2, 4, 4, 16)
    assert {name: getattr(cfg, name) for name in expected} == expected
    pixels = _pixels()
    with torch.no_grad():
        peer = {k: v.numpy() for k, v in outputs(model, pixels).items()}
    check_parity(f"hf-{case}", f"hf {cls_name}", converted, pixels.numpy(), peer, normed)


def test_hf_two_tower_checkpoint_gives_its_vision_tower(tmp_path):
    """A whole CLIPModel: the text tower is dropped by name; the vision side is image_embeds."""
    import transformers

    config = transformers.CLIPConfig(
        vision_config=dict(**SHAPE, intermediate_size=96),
        text_config=dict(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=50,
        ),
        projection_dim=20,
    )
    model = transformers.CLIPModel(config).eval()
    perturb(model, seed=21)
    model.save_pretrained(tmp_path / "clip")
    converted = convert("hf", tmp_path / "clip")
    assert converted.config.projection_dim == 20
    assert any("dropped the text tower" in note for note in converted.notes)
    pixels = _pixels()
    with torch.no_grad():
        peer = {"pooled": model.get_image_features(pixel_values=pixels)}
        peer = {k: getattr(v, "pooler_output", v).numpy() for k, v in peer.items()}
    check_parity("hf-clip-two-tower", "hf CLIPModel", converted, pixels.numpy(), peer, False)


def test_hf_config_that_contradicts_the_weights_names_both(tmp_path):
    model = _hf("Dinov2Model", "Dinov2Config", seed=3)
    model.save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 5}))
    with pytest.raises(
        ConvertError, match="num_hidden_layers: config.json has 5, the weights have 2"
    ):
        convert("hf", tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "model_type": "siglip"}))
    with pytest.raises(
        ConvertError,
        match="model_type='siglip', but the weights are laid out as 'dinov2'",
    ):
        convert("hf", tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "model_type": "swin"}))
    with pytest.raises(ConvertError, match="model_type='swin', which is not supported"):
        convert("hf", tmp_path / "m")
    # the image size must be the position table's grid, and square (a 3x5 table plus the class
    # token is 16 rows: it would read as a 4x4 grid without one)
    grid = config["image_size"] // config["patch_size"]
    for size, message in (
        ([16, 24], r"image_size=\[16, 24\], a non-square input"),
        (config["image_size"] * 2,
         rf"image_size // patch_size: config.json has {2 * grid}, the weights have {grid}"),
        ("16", r'config.json: image_size is "16", not a whole number > 0 or a list of 2 whole'),
    ):
        (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "image_size": size}))
        with pytest.raises(ConvertError, match=message):
            convert("hf", tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConvertError, match="--heads 2 contradicts config.json's "
                                           f"num_attention_heads={config['num_attention_heads']}"):
        convert("hf", tmp_path / "m", Hints(heads=2))
    assert convert("hf", tmp_path / "m", Hints(heads=config["num_attention_heads"])).config


def test_hf_rotary_model_with_a_non_square_size_is_refused(tmp_path):
    model = _hf("DINOv3ViTModel", "DINOv3ViTConfig", seed=4, intermediate_size=96)
    model.save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "image_size": [16, 32]}))
    with pytest.raises(ConvertError, match="a non-square input"):
        convert("hf", tmp_path / "m")


def test_hf_activation_names_compute_as_transformers_does():
    """Every hidden_act the converter reads is transformers' own function to float32's precision
    (gelu_python, gelu_fast, gelu_accurate, gelu_python_tanh were refused: the same two GELUs
    spelled otherwise)."""
    import jax.numpy as jnp
    from peers import rel_err
    from transformers.activations import ACT2FN
    from vit22b.model import ViTConfig
    from vit22b.model.convert_hf import _ACTIVATIONS
    from vit22b.model.vit import activation

    names = ("gelu", "gelu_python", "gelu_new", "gelu_pytorch_tanh", "gelu_python_tanh",
             "gelu_fast", "gelu_accurate", "quick_gelu")
    assert set(_ACTIVATIONS) == set(names)
    x = np.linspace(-8, 8, 2001, dtype=np.float32)
    for name in names:
        gelu_exact, mlp = _ACTIVATIONS[name]
        cfg = ViTConfig(mlp=mlp, gelu_exact=gelu_exact)
        expected = ACT2FN[name](torch.from_numpy(x)).numpy()
        assert rel_err(activation(jnp.asarray(x), cfg), expected) < 1e-6, name


def test_a_task_model_around_a_backbone_names_what_is_unsupported(tmp_path):
    """A backbone under a prefix this converter does not read (here DINOv3's, as a task model
    would hold it): the refusal says so."""
    model = _hf("DINOv3ViTModel", "DINOv3ViTConfig", seed=3, intermediate_size=96)
    tensors = {f"dinov3_vit.{k}": v.contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConvertError, match="a task model around dinov3_vit, which this "
                                           "converter does not read"):
        convert("hf", tmp_path / "model.safetensors")


# task model -> (its backbone's outputs, what the dropped classifier reads)
OTHER_CLASSIFIERS = {
    "Dinov2ForImageClassification": (lambda m, px: _dino_outputs(m.dinov2, px), "concatenated"),
    "Dinov2WithRegistersForImageClassification": (
        lambda m, px: _dino_outputs(m.dinov2_with_registers, px), "concatenated"),
    "CLIPForImageClassification": (
        lambda m, px: _clip_outputs(m.vision_model, px), "before post_layernorm"),
    "SiglipForImageClassification": (
        lambda m, px: _siglip_outputs(m.vision_model, px), "not the attention-pooling head"),
}


@pytest.mark.parametrize("cls_name", list(OTHER_CLASSIFIERS))
def test_a_classifier_reading_another_feature_is_dropped_and_the_features_served(cls_name,
                                                                                 tmp_path):
    """These classifiers read a feature the model does not serve as pooled (DINOv2's
    [CLS, mean of the patches], CLIP's mean of un-normed patches, SigLIP's mean instead of its
    MAP head): served with the pooled output they gave other logits than the source (CLIP's and
    SigLIP's were). Dropped by name; the backbone's features equal the source's."""
    import transformers

    outputs, reads = OTHER_CLASSIFIERS[cls_name]
    family = cls_name.removesuffix("ForImageClassification")
    if family in ("CLIP", "Siglip"):
        text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=64)
        config = getattr(transformers, f"{family}Config")(
            vision_config=dict(**SHAPE, intermediate_size=96), text_config=text, num_labels=3)
    else:
        extra = dict(num_register_tokens=2) if "Registers" in family else {}
        config = getattr(transformers, f"{family}Config")(**SHAPE, num_labels=3, **extra)
    model = getattr(transformers, cls_name)(config).eval()
    perturb(model, seed=9)
    model.save_pretrained(tmp_path / "m")
    converted = convert("hf", tmp_path / "m")
    assert converted.config.num_classes == 0
    assert any(note.startswith("dropped classifier.weight (3, ") and reads in note
               and cls_name in note for note in converted.notes), converted.notes
    pixels = _pixels()
    with torch.no_grad():
        peer = {k: v.numpy() for k, v in outputs(model, pixels).items()}
    check_parity(f"hf-{cls_name}", f"hf {cls_name}", converted, pixels.numpy(), peer,
                 family != "CLIP")


# task model -> (config, its backbone's attribute, whether its logits are served, a note it gives)
VIT_LAYOUT_TASKS = {
    "ViTMSNForImageClassification": ("ViTMSNConfig", "vit", True, None),
    "IJepaForImageClassification": ("IJepaConfig", "ijepa", True, "IJepaForImageClassification"),
    "DeiTForImageClassification": ("DeiTConfig", "deit", True, "distillation token is served"),
    "DeiTForImageClassificationWithTeacher": (
        "DeiTConfig", "deit", False, "DeiT's two classifiers"),
    "ViTMAEForPreTraining": ("ViTMAEConfig", "vit", False, "dropped ViT-MAE's pixel decoder"),
}


@pytest.mark.parametrize("cls_name", list(VIT_LAYOUT_TASKS))
def test_task_models_on_vits_layout_give_their_backbone_and_its_classifier(cls_name, tmp_path):
    """Their hub files: the backbone under its prefix, a classifier served where the model can
    compute it (on the class token; I-JEPA's on the mean), DeiT's teacher heads and ViT-MAE's
    decoder dropped with a note. ViT-MAE's file says mask_ratio 0.75: every patch is served."""
    config_name, backbone, logits, note = VIT_LAYOUT_TASKS[cls_name]
    extra = dict(num_labels=5) if "Classification" in cls_name else dict(
        decoder_hidden_size=32, decoder_num_hidden_layers=1, decoder_num_attention_heads=4,
        decoder_intermediate_size=64, mask_ratio=0.75)
    model = _hf(cls_name, config_name, seed=5 + len(cls_name), intermediate_size=96, **extra)
    model.save_pretrained(tmp_path / "m")
    converted = convert("hf", tmp_path / "m")
    assert converted.config.num_classes == (5 if logits else 0)
    assert note is None or any(note in n for n in converted.notes), converted.notes
    if "MAE" in cls_name:
        assert any("mask_ratio=0.75 hides patches in pre-training only" in n
                   for n in converted.notes)
        model.config.mask_ratio = 0.0  # the unmasked encoder the features are read from
    pixels = _pixels()
    with torch.no_grad():
        peer = vit_layout_outputs(getattr(model, backbone), pixels)
        if logits:
            peer["logits"] = model(pixel_values=pixels).logits
    check_parity(f"hf-{cls_name}", f"hf {cls_name}", converted, pixels.numpy(),
                 {k: v.numpy() for k, v in peer.items()}, True)


def test_a_model_types_own_epsilon_is_its_default_where_config_json_gives_none(tmp_path):
    """ViT-MSN's config defaults layer_norm_eps to 1e-6, not ViT's 1e-12 (3.9e-5 off before)."""
    model = _hf("ViTMSNModel", "ViTMSNConfig", seed=4, intermediate_size=96, layer_norm_eps=1e-6)
    model.save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    del config["layer_norm_eps"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    converted = convert("hf", tmp_path / "m")
    assert converted.config.norm_eps == 1e-6
    assert "config.json gives no layer_norm_eps: LayerNorm epsilon 1e-06 (vit_msn's default)" in (
        converted.notes)
    pixels = _pixels()
    with torch.no_grad():
        peer = {k: v.numpy() for k, v in vit_layout_outputs(model, pixels).items()}
    check_parity("hf-vit-msn-default-eps", "hf ViTMSNModel", converted, pixels.numpy(), peer, True)


def test_a_vit_layout_without_a_class_token_is_read_as_i_jepa_only_where_config_allows(tmp_path):
    """A ViT whose class token is missing is a damaged file, not an I-JEPA; without config.json
    the position table decides (one row per patch: no class token)."""
    model = _hf("ViTModel", "ViTConfig", seed=3, intermediate_size=96)
    model.save_pretrained(tmp_path / "vit")
    weights = tmp_path / "vit" / "model.safetensors"
    from safetensors.numpy import load_file
    from safetensors.numpy import save_file as save_numpy
    tensors = load_file(weights)
    del tensors["embeddings.cls_token"]
    save_numpy(tensors, weights)
    with pytest.raises(ConvertError, match="missing key 'embeddings.cls_token'"):
        convert("hf", tmp_path / "vit")
    (tmp_path / "vit" / "config.json").unlink()
    with pytest.raises(ConvertError, match="position embedding of 17 tokens is not a square"):
        convert("hf", tmp_path / "vit", Hints(heads=4))


def test_hf_preprocessing_comes_from_the_processor_file(tmp_path):
    import transformers

    model = _hf("CLIPVisionModel", "CLIPVisionConfig", seed=5, intermediate_size=96)
    model.save_pretrained(tmp_path / "m")
    processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}
    )
    processor.save_pretrained(tmp_path / "m")
    p = convert("hf", tmp_path / "m").config.preprocess
    assert p.resize == 16 and p.interpolation == "bicubic"
    assert p.mean == tuple(processor.image_mean) and p.std == tuple(processor.image_std)
    # a crop other than the table's size: served at the crop, the 4x4 table kept (resampled)
    other = transformers.CLIPImageProcessor(
        size={"shortest_edge": 20}, crop_size={"height": 20, "width": 20}
    )
    other.save_pretrained(tmp_path / "m")
    cfg = convert("hf", tmp_path / "m").config
    assert (cfg.image_size, cfg.posemb_grid, cfg.preprocess.resize) == (20, 4, 20)
    odd = transformers.CLIPImageProcessor(
        size={"shortest_edge": 18}, crop_size={"height": 18, "width": 18}
    )
    odd.save_pretrained(tmp_path / "m")
    with pytest.raises(ConvertError, match="18x18 inputs, not a whole number of 4x4 patches"):
        convert("hf", tmp_path / "m")


# ------------------------------------------------------------------------------------------
# timm
# ------------------------------------------------------------------------------------------

TIMM_SHAPE = dict(img_size=16, patch_size=4, embed_dim=48, depth=2, num_heads=4)
TIMM_CASES = {
    # LayerScale (folded into the out-projections), class token, pos_embed covering it
    "dinov2": ("vit_base_patch14_dinov2", {"num_registers": 0, "posemb_covers_cls": True}),
    # 4 register tokens; pos_embed for the patches only (no_embed_class)
    "dinov2-reg4": (
        "vit_base_patch14_reg4_dinov2",
        {"num_registers": 4, "posemb_covers_cls": False},
    ),
    # the giant's SwiGLUPacked MLP: fc1 = [gate | value], silu
    "dinov2-giant-swiglu": ("vit_giant_patch14_dinov2", {"mlp": "swiglu"}),
    # attention-pool head (AttentionPoolLatent), no class token
    "siglip": ("vit_base_patch16_siglip_224", {"head": "map", "class_token": False}),
    # SigLIP 2's towers pass act_layer='gelu_tanh' themselves, which config.json does not
    # record: read by the architecture's name (was the exact GELU: pooled 1e-4 off)
    "siglip2-gelu-tanh": ("vit_so400m_patch16_siglip_256", {"head": "map", "gelu_exact": False}),
    # OpenAI CLIP in timm: norm_pre, quick-GELU (named by the architecture), projection as head
    "clip-quickgelu": (
        "vit_base_patch16_clip_quickgelu_224",
        {"mlp": "quick_gelu", "pre_norm": True, "num_classes": 12},
    ),
    # the activation named by config.json's model_args.act_layer, not by the architecture
    "act-gelu-tanh": (
        "vit_base_patch16_224", {"mlp": "gelu", "gelu_exact": False}, dict(act_layer="gelu_tanh")
    ),
    "act-quick-gelu": (
        "vit_base_patch16_224",
        {"mlp": "quick_gelu", "pre_norm": True},
        dict(act_layer="quick_gelu", pre_norm=True),
    ),
    # timm's default no_embed_class=False with registers: a table row for every prefix token
    # (the SBB so150m2 ViTs)
    "reg-covered": (
        "vit_base_patch16_224",
        {"num_registers": 4, "posemb_covers_cls": True, "posemb_covers_registers": True},
        dict(reg_tokens=4),
    ),
    "reg-covered-no-class": (
        "vit_base_patch16_224",
        {"num_registers": 2, "class_token": False, "posemb_covers_registers": True,
         "pool_norm": True},
        dict(reg_tokens=2, class_token=False, global_pool="avg"),
    ),
    # eva.py's DINOv3 port, read as transformers' DINOv3ViTModel: 2-D RoPE, 4 registers,
    # LayerScale; pooled as timm pools these models by default (the patch tokens' mean) ...
    "dinov3": ("vit_base_patch16_dinov3", {"posemb": "rope", "num_registers": 4, "head": "gap"}),
    # ... or the class token (upstream's pooling); q and v biases, no k bias
    "dinov3-token-qkvb": (
        "vit_small_patch16_dinov3_qkvb",
        {"posemb": "rope", "head": "cls", "qkv_bias": True},
        dict(global_pool="token"),
    ),
    # SwiGLU with its gate and value apart (fc1_g, fc1_x)
    "dinov3-swiglu": ("vit_small_plus_patch16_dinov3", {"posemb": "rope", "mlp": "swiglu"}),
    # no registers (timm keeps no tensor for them: was "missing key 'embeddings.register_tokens'")
    # and q, k, v apart (qkv_fused=False: was refused by its key)
    "dinov3-noreg-unfused": (
        "vit_base_patch16_dinov3", {"posemb": "rope", "num_registers": 0},
        dict(num_reg_tokens=0, qkv_fused=False),
    ),
    # DeiT distilled (VisionTransformerDistilled): the distillation token served as a register
    # with its table row; pooled as timm's pre-logits, (CLS + distillation) / 2; its two heads
    # (logits: their mean) dropped. Refused by its key before.
    "deit-distilled": (
        "deit_small_distilled_patch16_224",
        {"head": "prefix", "num_registers": 1, "posemb_covers_registers": True, "num_classes": 0},
    ),
}
# flexible-size models are served at pretrained_cfg's input size, whatever size they were built at
TIMM_SERVED_SIZE = {"dinov3": 256}


def timm_converted(name: str, folder, seed: int, preprocess=None, **kw):
    """A perturbed timm model saved as timm does (safetensors + config.json), and converted
    (``preprocess``: PreprocessFlags over what its pretrained_cfg says)."""
    model = timm.create_model(name, pretrained=False, **{**TIMM_SHAPE, **kw}).eval()
    perturb(model, seed=seed)
    folder.mkdir()
    save_file(model.state_dict(), str(folder / "model.safetensors"))
    save_config_for_hf(model, str(folder / "config.json"))
    return model, convert("timm", folder, preprocess=preprocess)


def timm_outputs(model, pixels) -> dict:
    """timm's pooled (pre-logits), patch and register tokens as numpy."""
    with torch.no_grad():
        tokens = model.forward_features(pixels)
        prefix = model.num_prefix_tokens
        peer = {
            "pooled": model.forward_head(tokens, pre_logits=True),
            "patch_tokens": tokens[:, prefix:],
        }
        n_cls = int(model.cls_token is not None)
        if prefix > n_cls:
            peer["register_tokens"] = tokens[:, n_cls:prefix]
    return {k: v.numpy() for k, v in peer.items()}


@pytest.mark.parametrize("case", list(TIMM_CASES))
def test_timm_parity(case, tmp_path):
    name, expected, *kwargs = TIMM_CASES[case]
    extra = {"num_classes": 12} if "clip" in case else {"num_classes": 0}
    model, converted = timm_converted(name, tmp_path / case, 31 + len(case), **extra,
                                      **(kwargs[0] if kwargs else {}))
    cfg = converted.config
    size = TIMM_SERVED_SIZE.get(case.partition("-")[0], 16)
    assert (cfg.width, cfg.depth, cfg.heads, cfg.patch, cfg.image_size) == (48, 2, 4, 4, size)
    assert {k: getattr(cfg, k) for k in expected} == expected
    pixels = _pixels()
    peer = timm_outputs(model, pixels)
    check_parity(f"timm-{case}", f"timm {name}", converted, pixels.numpy(), peer, True)


@pytest.mark.parametrize("name", ["vit_base_patch14_dinov2", "vit_base_patch14_reg4_dinov2",
                                  "vit_giant_patch14_dinov2"])
def test_dinov2_release_files_are_read_as_timm_reads_them(name, tmp_path):
    """facebookresearch/dinov2's own torch.hub files (dinov2_vitb14_pretrain.pth, ...): timm's
    names but a mask token, 'register_tokens' with the class token's row in the position table,
    and the giant's SwiGLU as w12 / w3. Refused before ("unexpected key 'mask_token'"); now
    renamed as timm's loader renames them, served as timm computes the model."""
    model = timm.create_model(name, pretrained=False, num_classes=0, **TIMM_SHAPE).eval()
    perturb(model, seed=17)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    release = {"mask_token": torch.zeros(1, 48)}
    for key, value in state.items():  # the giant's SwiGLU: w12 (gate | value) and w3
        packed = "giant" in name
        release[key.replace("mlp.fc1.", "mlp.w12.").replace("mlp.fc2.", "mlp.w3.") if packed
                else key] = value
    if "reg_token" in state:  # the release's class token has its own row of the table
        row = torch.randn(1, 1, 48) * 0.1
        release["register_tokens"] = release.pop("reg_token")
        release["cls_token"] = state["cls_token"] - row
        release["pos_embed"] = torch.cat([row, state["pos_embed"]], dim=1)
    torch.save(release, tmp_path / "release.pth")
    converted = convert("timm", tmp_path / "release.pth", Hints(heads=4))
    assert any("facebookresearch/dinov2's release layout" in note for note in converted.notes)
    if "register_tokens" in release:  # a register file missing its table: named, no KeyError
        del release["pos_embed"]
        torch.save(release, tmp_path / "partial.pth")
        with pytest.raises(ConvertError, match=r"release layout \(a mask token, register_tokens\) "
                                               r"with no 'pos_embed': not such a file whole"):
            convert("timm", tmp_path / "partial.pth", Hints(heads=4))
    pixels = _pixels()
    check_parity(f"dinov2-release-{name}", f"timm {name}", converted, pixels.numpy(),
                 timm_outputs(model, pixels), True)


def test_a_timm_dynamic_size_export_keeps_its_table_and_resamples_it_as_timm_does(tmp_path):
    """timm keeps pretrained_cfg's input size (224) in the config.json of a model built at
    img_size 16 with dynamic_img_size: served at 224 from its 4x4 table; at another size the
    table is resampled as timm's own forward resamples it."""
    model, converted = timm_converted("vit_base_patch16_224", tmp_path / "dyn", 5, num_classes=0,
                                      dynamic_img_size=True)
    cfg = converted.config
    assert (cfg.image_size, cfg.table_grid) == (224, (4, 4))
    pixels = _pixels(size=24)
    check_parity("timm-dynamic-size", "timm vit_base_patch16_224", converted, pixels.numpy(),
                 timm_outputs(model, pixels), True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(global_pool="avg", fc_norm=False, pool_include_prefix=True), "pool_include_prefix"),
    (dict(act_layer="relu"), "act_layer='relu' is not supported"),
    # SimpleNorm (x / sqrt(unbiased var)) has no bias either: it was read as RMSNorm
    (dict(norm_layer="simplenorm"), "norm_layer='simplenorm' is not supported"),
    (dict(img_size=[16, 24]), r"model_args.img_size=\[16, 24\], a non-square input"),
    (dict(img_size=[16, 32], patch_size=[4, 8]), "embeds 4x8 patches: only square patches"),
    (dict(scale_attn_norm=True), r"a norm inside attention \(timm scale_attn_norm\)"),
    (dict(scale_mlp_norm=True), r"a norm inside the MLP \(timm scale_mlp_norm\)"),
    (dict(attn_layer="diff"), r"differential attention \(timm attn_layer='diff'\)"),
    # converted, then every served (RGB) request failed on the compiled program's 4 channels
    (dict(in_chans=4), "takes 4-channel images"),
])
def test_timm_options_the_model_cannot_express_are_refused_by_name(kwargs, message, tmp_path):
    with pytest.raises(ConvertError, match=message):
        timm_converted("vit_base_patch16_224", tmp_path / "m", 3, num_classes=0, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    # rotary pairs interleaved, not halves: the weights look the same
    (dict(rope_rotate_half=False), r"rope_rotate_half=False is not supported \(DINOv3's is "
                                   "True"),
    (dict(rope_type="cat"), r"rope_type='cat' is not supported \(DINOv3's is 'dinov3'"),
    (dict(use_abs_pos_emb=True), r"use_abs_pos_emb=True is not supported"),
    (dict(use_fc_norm=True), r"a norm after pooling \(timm use_fc_norm\)"),
    (dict(scale_attn_inner=True), r"a norm inside attention \(timm scale_attn_inner\)"),
    (dict(scale_mlp=True), r"a norm inside the MLP \(timm scale_mlp\)"),
    (dict(global_pool="max"), r"global_pool='max' is not supported"),
    (dict(pretrained_cfg_overlay=dict(input_size=(3, 256, 320))),
     r"pretrained_cfg.input_size=\[3, 256, 320\], a non-square input"),
    # options the weights do not show, each converted without a word before: features off by
    # up to 63% (use_post_norm), 0.4% (rope_grid_indexing='xy'), 0.16% (rope_grid_offset)
    (dict(use_post_norm=True), r"model_args.use_post_norm=True is not supported \(DINOv3's is "
                               "False"),
    (dict(rope_grid_indexing="xy"), r"model_args.rope_grid_indexing='xy' is not supported"),
    (dict(rope_grid_offset=0.5), r"model_args.rope_grid_offset=0.5 is not supported"),
    # options the weights show, named as timm's (were bare key lists in transformers' names)
    (dict(class_token=False), r"no class token \(timm class_token=False\)"),
    (dict(qk_norm=True), r"a norm of queries and keys \(timm qk_norm=True\)"),
    (dict(use_pre_transformer_norm=True), r"timm use_pre_transformer_norm=True"),
    (dict(use_post_transformer_norm=False), r"no final norm \(timm use_post_transformer_norm"),
])
def test_timm_dinov3_options_the_model_cannot_express_are_refused_by_name(kwargs, message,
                                                                          tmp_path):
    with pytest.raises(ConvertError, match=message):
        timm_converted("vit_base_patch16_dinov3", tmp_path / "m", 3, num_classes=0, **kwargs)


@pytest.mark.parametrize("name, family", [("vit_base_patch16_dinov3", "DINOv3 port"),
                                          ("vit_base_patch16_224", "VisionTransformer")])
def test_a_timm_option_this_converter_does_not_know_is_refused_by_name(name, family, tmp_path):
    """A model_args key the converter reads nowhere (a newer timm's option) is refused, not
    ignored: an unread option is how use_post_norm converted to wrong features."""
    model = timm.create_model(name, pretrained=False, img_size=32, patch_size=8, embed_dim=48,
                              depth=1, num_heads=4, num_classes=0).eval()
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    save_config_for_hf(model, str(tmp_path / "config.json"))
    convert("timm", tmp_path)  # as saved: every key known
    side = json.loads((tmp_path / "config.json").read_text())
    side["model_args"]["future_option"] = 2
    (tmp_path / "config.json").write_text(json.dumps(side))
    with pytest.raises(ConvertError, match=r"model_args.future_option=2 is not an option "
                                           f"this converter reads for timm's {family}"):
        convert("timm", tmp_path)


def test_timm_dinov3_heads_come_from_the_architecture_when_its_config_has_no_model_args(tmp_path):
    """A hub config.json records no model_args: the heads are the registration's (12 for the
    base), and a --heads against them is said in timm's words, not transformers'."""
    model = timm.create_model("vit_base_patch16_dinov3", pretrained=False, img_size=32,
                              patch_size=8, embed_dim=48, depth=1, num_classes=0).eval()
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(
        {"architecture": "vit_base_patch16_dinov3", "num_classes": 0}))
    assert convert("timm", tmp_path).config.heads == 12
    with pytest.raises(ConvertError, match=r"timm vit_base_patch16_dinov3 checkpoint: --heads 4 "
                                           r"contradicts the architecture's num_heads=12"):
        convert("timm", tmp_path, Hints(heads=4))


def test_a_timm_table_covering_its_registers_is_read_by_its_length_or_its_config(tmp_path):
    """Without a config.json, 64 + 1 + 4 rows are a table covering every prefix token (64 + 5
    is no square); with one, model_args.img_size tells 2x2 + 5 rows from a 3x3 grid. Both are
    served as timm computes them, the second also resampled to another grid."""
    model = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=0,
                              **{**TIMM_SHAPE, "img_size": 32}, reg_tokens=4, no_embed_class=False)
    perturb(model, seed=4)
    save_file(model.state_dict(), str(tmp_path / "m.safetensors"))
    converted = convert("timm", tmp_path / "m.safetensors", Hints(heads=4))
    assert converted.config.table_grid == (8, 8) and converted.config.posemb_covers_registers
    pixels = _pixels(size=32)
    check_parity("timm-reg-covered-bare", "timm vit_base_patch16_224", converted,
                 pixels.numpy(), timm_outputs(model, pixels), True)
    model, converted = timm_converted("vit_base_patch16_224", tmp_path / "small", 6,
                                      num_classes=0, img_size=8, reg_tokens=4,
                                      dynamic_img_size=True)
    assert converted.config.table_grid == (2, 2) and converted.config.posemb_covers_registers
    pixels = _pixels(size=12)  # a 3x3 grid: the table resampled, its 5 prefix rows kept
    check_parity("timm-reg-covered-resampled", "timm vit_base_patch16_224", converted,
                 pixels.numpy(), timm_outputs(model, pixels), True)


def test_a_bare_timm_state_dict_says_how_its_pooling_was_read(tmp_path):
    model = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=0,
                              **TIMM_SHAPE)
    save_file(model.state_dict(), str(tmp_path / "m.safetensors"))
    converted = convert("timm", tmp_path / "m.safetensors", Hints(heads=4))
    assert converted.config.head == "cls"
    assert any("global_pool" in note and "class token" in note for note in converted.notes)


@pytest.mark.parametrize("source", ["hf", "timm"])
def test_bfloat16_weights_with_layer_scale_keep_float32_parameters(source, tmp_path):
    """LayerScale is folded into the projections in float32; rounding the products to bfloat16
    again moves float32 features outside the parity bound: kept in float32 unless --dtype says."""
    if source == "hf":
        model = _hf("Dinov2Model", "Dinov2Config", seed=5, layerscale_value=0.5).to(torch.bfloat16)
        model.save_pretrained(tmp_path / "m")
        path, hints = tmp_path / "m", {}
    else:
        model = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=0,
                                  **TIMM_SHAPE, init_values=0.5).eval()
        perturb(model, seed=5)
        model = model.to(torch.bfloat16)
        save_file(model.state_dict(), str(tmp_path / "m.safetensors"))
        path, hints = tmp_path / "m.safetensors", {"heads": 4}
    model = model.float()  # the peer: the same bfloat16 values, computed in float32
    converted = convert(source, path, Hints(**hints))
    assert converted.config.param_dtype == "float32"
    assert any("LayerScale folded" in note for note in converted.notes)
    pixels = _pixels()
    with torch.no_grad():
        peer = (_dino_outputs(model, pixels) if source == "hf" else
                {k: torch.from_numpy(v) for k, v in timm_outputs(model, pixels).items()})
    check_parity(f"{source}-bf16-layerscale", source, converted, pixels.numpy(),
                 {k: v.numpy() for k, v in peer.items()}, True)
    kept = convert(source, path, Hints(**hints, dtype="bfloat16"))
    assert kept.config.param_dtype == "bfloat16"
    rounded = our_outputs(kept, pixels.numpy().transpose(0, 2, 3, 1), "float32",
                    OutputRequest(pooled=True))["pooled"]
    assert rel_err(rounded, peer["pooled"].numpy()) > 10 * TOL_F32  # why they are kept


# ------------------------------------------------------------------------------------------
# OpenCLIP
# ------------------------------------------------------------------------------------------

OPEN_CLIP_CFG = {
    "embed_dim": 24,
    "quick_gelu": True,
    "vision_cfg": dict(
        image_size=16,
        layers=2,
        width=48,
        head_width=12,
        patch_size=4,
        mlp_ratio=2.5,
        ls_init_value=0.1,
    ),
    "text_cfg": dict(context_length=8, vocab_size=50, width=32, heads=2, layers=1),
}


@pytest.mark.parametrize("quick_gelu", [True, False])
def test_open_clip_parity_through_its_own_loader(quick_gelu, tmp_path):
    """A whole CLIP state dict (visual.* and the text tower) with its open_clip_config.json,
    loaded back by open_clip's own create_model('local-dir:...') as the peer."""
    open_clip = import_open_clip()
    model_cfg = {**OPEN_CLIP_CFG, "quick_gelu": quick_gelu}
    model = open_clip.model.CLIP(**{k: v for k, v in model_cfg.items()}).eval()
    perturb(model, seed=41 + quick_gelu)
    folder = tmp_path / "oc"
    folder.mkdir()
    torch.save(model.state_dict(), folder / "open_clip_pytorch_model.bin")
    preprocess = {"mean": [0.4, 0.45, 0.5], "std": [0.2, 0.25, 0.3], "interpolation": "bilinear"}
    (folder / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": model_cfg, "preprocess_cfg": preprocess})
    )
    peer_model = open_clip.create_model(f"local-dir:{folder}").eval()
    converted = convert("open_clip", folder)
    cfg = converted.config
    assert cfg.mlp == ("quick_gelu" if quick_gelu else "gelu") and cfg.projection_dim == 24
    assert (cfg.width, cfg.heads, cfg.mlp_dim, cfg.image_size) == (48, 4, 120, 16)
    assert cfg.preprocess.mean == (0.4, 0.45, 0.5) and cfg.preprocess.interpolation == "bilinear"
    assert any("dropped the text tower" in note for note in converted.notes)
    pixels = _pixels()
    peer_model.visual.output_tokens = True
    with torch.no_grad():
        pooled, tokens = peer_model.visual(pixels)
        assert torch.allclose(pooled, model.encode_image(pixels))  # the loader read every weight
    peer = {"pooled": pooled.numpy(), "patch_tokens": tokens.numpy()}  # tokens: after ln_post
    check_parity(
        f"open_clip-quick_gelu={quick_gelu}",
        "open_clip CLIP",
        converted,
        pixels.numpy(),
        peer,
        True,
    )


def _open_clip_folder(folder, model_cfg: dict, preprocess: dict | None = None, seed: int = 0):
    """A perturbed open_clip CLIP saved as open_clip saves it, and open_clip's own reload."""
    open_clip = import_open_clip()
    model = open_clip.model.CLIP(**model_cfg).eval()
    perturb(model, seed=seed)
    folder.mkdir()
    torch.save(model.state_dict(), folder / "open_clip_pytorch_model.bin")
    side = {"model_cfg": model_cfg, **({"preprocess_cfg": preprocess} if preprocess else {})}
    (folder / "open_clip_config.json").write_text(json.dumps(side))
    return open_clip.create_model(f"local-dir:{folder}").eval()


@pytest.mark.parametrize("layout", ["hub", "model_configs"])
def test_open_clip_norm_and_activation_arguments_are_the_configs(layout, tmp_path):
    """vision_cfg's norm_kwargs (eps) and act_kwargs (GELU's tanh form) are read, not assumed;
    a preprocessing size other than the tower's keeps the tower's table (resampled when
    served). A config in the layout of open_clip's own model_configs/*.json (no model_cfg
    around it) was read as no file: eps 1e-5 and the exact GELU, features off by 7%."""
    vision = {**OPEN_CLIP_CFG["vision_cfg"], "norm_kwargs": {"eps": 1e-2},
              "act_kwargs": {"approximate": "tanh"}}
    model_cfg = {**OPEN_CLIP_CFG, "quick_gelu": False, "vision_cfg": vision}
    peer_model = _open_clip_folder(tmp_path / "oc", model_cfg, {"size": 24}, seed=7)
    if layout == "model_configs":
        side = tmp_path / "oc" / "open_clip_config.json"
        side.write_text(json.dumps({**model_cfg, "preprocess_cfg": {"size": 24}}))
    converted = convert("open_clip", tmp_path / "oc")
    cfg = converted.config
    assert (cfg.norm_eps, cfg.gelu_exact, cfg.image_size, cfg.table_grid) == \
        (1e-2, False, 24, (4, 4))
    pixels = _pixels()  # the tower's own 16 px: open_clip's forward runs only there
    peer_model.visual.output_tokens = True
    with torch.no_grad():
        pooled, tokens = peer_model.visual(pixels)
    check_parity("open_clip-norm-act-kwargs", "open_clip CLIP", converted, pixels.numpy(),
                 {"pooled": pooled.numpy(), "patch_tokens": tokens.numpy()}, True)


@pytest.mark.parametrize("vision, message", [
    ({"norm_kwargs": {"elementwise_affine": False}}, "norm_kwargs.elementwise_affine"),
    ({"scale_heads": True}, r"a learned scale per head \(scale_heads\)"),
    ({"scale_attn": True}, r"a norm after attention \(scale_attn\)"),
    ({"scale_attn_inner": True}, r"a norm inside attention \(scale_attn_inner\)"),
    ({"qk_norm": True}, r"QK-norm \(qk_norm\)"),
    ({"scaled_cosine_attn": True}, r"\(scaled_cosine_attn\)"),
])
def test_open_clip_arguments_it_cannot_express_are_refused(vision, message, tmp_path):
    """vision_cfg's custom-block options are refused by name (were unexpected keys)."""
    vision = {**OPEN_CLIP_CFG["vision_cfg"], **vision}
    _open_clip_folder(tmp_path / "oc", {**OPEN_CLIP_CFG, "vision_cfg": vision})
    with pytest.raises(ConvertError, match=message):
        convert("open_clip", tmp_path / "oc")


def test_open_clip_without_its_config_needs_the_activation(tmp_path):
    open_clip = import_open_clip()
    model = open_clip.model.CLIP(**OPEN_CLIP_CFG).eval()
    save_file(
        {k: v.contiguous() for k, v in model.visual.state_dict().items()},
        str(tmp_path / "visual.safetensors"),
    )
    with pytest.raises(ConvertError, match="GELU or QuickGELU.*--mlp gelu\\|quick_gelu"):
        convert("open_clip", tmp_path / "visual.safetensors", Hints(heads=4))
    converted = convert(
        "open_clip", tmp_path / "visual.safetensors", Hints(heads=4, mlp="quick_gelu")
    )
    assert converted.config.mlp == "quick_gelu"
    assert any("no vision_cfg (no open_clip_config.json, or none in it): pooling read as the "
               "class token" in note
               for note in converted.notes)  # what a bare tower's code could have said


def test_an_open_clip_config_in_both_layouts_at_once_is_refused(tmp_path):
    _open_clip_folder(tmp_path / "oc", OPEN_CLIP_CFG)
    side = tmp_path / "oc" / "open_clip_config.json"
    side.write_text(json.dumps({"model_cfg": OPEN_CLIP_CFG, "quick_gelu": False}))
    with pytest.raises(ConvertError, match="has both a model_cfg and quick_gelu outside it"):
        convert("open_clip", tmp_path / "oc")


def test_open_clip_head_counts_sizes_and_towers_as_open_clip_reads_them(tmp_path):
    """open_clip floors width // head_width (72 // 32: 2 heads of 36); an image size that is
    not whole patches, a non-square one and a timm-built tower are refused by name."""
    vision = {**OPEN_CLIP_CFG["vision_cfg"], "width": 72, "head_width": 32}
    peer_model = _open_clip_folder(tmp_path / "oc", {**OPEN_CLIP_CFG, "vision_cfg": vision},
                                   seed=9)
    converted = convert("open_clip", tmp_path / "oc")
    assert (converted.config.heads, converted.config.head_dim) == (2, 36)
    pixels = _pixels()
    with torch.no_grad():
        pooled = peer_model.visual(pixels)
    check_parity("open_clip-floored-heads", "open_clip CLIP", converted, pixels.numpy(),
                 {"pooled": pooled.numpy()}, True)
    config = json.loads((tmp_path / "oc" / "open_clip_config.json").read_text())
    for size, message in ((18, "image_size=18 is not a whole number of 4-pixel patches"),
                          ([16, 32], r"image_size=\[16, 32\], a non-square input")):
        config["model_cfg"]["vision_cfg"]["image_size"] = size
        (tmp_path / "oc" / "open_clip_config.json").write_text(json.dumps(config))
        with pytest.raises(ConvertError, match=message):
            convert("open_clip", tmp_path / "oc")
    save_file({"visual.trunk.patch_embed.proj.weight": torch.zeros(48, 3, 4, 4)},
              str(tmp_path / "timm_tower.safetensors"))
    with pytest.raises(ConvertError, match="an image tower built on a timm model"):
        convert("open_clip", tmp_path / "timm_tower.safetensors", Hints(heads=4, mlp="gelu"))


# ------------------------------------------------------------------------------------------
# presets: the public shapes, counted as the sources' own code counts them
# ------------------------------------------------------------------------------------------

_L = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16)
# preset: (transformers model, its config, parameters the source has and the preset does not:
# the mask token, used only in training; LayerScale, folded into the out-projections at import,
# 2 x width per block; DINOv3's missing key bias, which the preset holds as zeros, counts minus)
PRESET_SOURCES = {
    "dinov2-b/14": (
        "Dinov2Model",
        "Dinov2Config",
        dict(image_size=518, patch_size=14),
        768 + 24 * 768,
    ),
    "dinov2-g/14": (
        "Dinov2Model",
        "Dinov2Config",
        dict(
            hidden_size=1536,
            num_hidden_layers=40,
            num_attention_heads=24,
            image_size=518,
            patch_size=14,
            use_swiglu_ffn=True,
        ),
        1536 + 80 * 1536,
    ),
    "dinov2-reg-b/14": (
        "Dinov2WithRegistersModel",
        "Dinov2WithRegistersConfig",
        dict(image_size=518, patch_size=14, num_register_tokens=4),
        768 + 24 * 768,
    ),
    "dinov3-l/16": (
        "DINOv3ViTModel",
        "DINOv3ViTConfig",
        dict(**_L, intermediate_size=4096, patch_size=16, num_register_tokens=4),
        1024 + 48 * 1024 - 24 * 1024,
    ),
    "siglip-so400m/14": (
        "SiglipVisionModel",
        "SiglipVisionConfig",
        dict(
            hidden_size=1152,
            intermediate_size=4304,
            num_hidden_layers=27,
            num_attention_heads=16,
            patch_size=14,
            image_size=224,
        ),
        0,
    ),
    "clip-l/14": (
        "CLIPVisionModelWithProjection",
        "CLIPVisionConfig",
        dict(**_L, intermediate_size=4096, patch_size=14, image_size=224, projection_dim=768),
        0,
    ),
}


@pytest.mark.parametrize("preset", list(PRESET_SOURCES))
def test_preset_parameter_counts_are_the_sources(preset):
    import transformers
    from vit22b.model import get_config
    from vit22b.model.info import model_info

    cls_name, config_name, kw, not_ours = PRESET_SOURCES[preset]
    with torch.device("meta"):  # the source's own modules, no memory
        model = getattr(transformers, cls_name)(getattr(transformers, config_name)(**kw))
    source = sum(p.numel() for p in model.parameters())
    info = model_info(get_config(preset))
    assert info["total_param_count"] == source - not_ours


# ------------------------------------------------------------------------------------------
# served: converted by the command line in float32 compute, over gRPC
# ------------------------------------------------------------------------------------------


# case -> the processor file it is served with (else none: images at the model's own size)
SERVED_PROCESSORS = {  # DeiT's own kind: both sides to 20, then the 16 crop (keep_aspect false)
    "deit": {"image_processor_type": "DeiTImageProcessor", "size": 20, "crop_size": 16,
             "do_center_crop": True, "resample": 3},
}


@pytest.mark.parametrize("case", ["dinov2-registers", "clip-projection", "siglip", "deit"])
def test_served_over_grpc_in_float32_equals_the_source(case, tmp_path, capsys):
    """`vit22b convert --compute-dtype float32` (no --model), `BackgroundServer` on the
    checkpoint, raw uint8 images at the model's size through the SDK: pooled and last-layer
    patch tokens equal the source's forward on the same normalised pixels to 1e-5. With a
    processor file (DeiT's), 24x30 images, and the source's pixels are its processor's."""
    from parity import TOL_F32
    from peers import rel_err
    from vit22b.clients import FeatureClient
    from vit22b.clients.cli import main
    from vit22b.server.app import BackgroundServer, build_engine
    from vit22b.server.settings import ServeConfig
    from vit22b.v1 import wire

    cls_name, config_name, kw, outputs, normed, _ = HF_CASES[case]
    model = _hf(cls_name, config_name, seed=51 + len(case), **kw)
    model.save_pretrained(tmp_path / "hf")
    processor = SERVED_PROCESSORS.get(case)
    if processor:
        (tmp_path / "hf" / "preprocessor_config.json").write_text(json.dumps(processor))
    ckpt = tmp_path / "ckpt"
    args = ["convert", "--from", "hf", "--input", str(tmp_path / "hf"), "--out", str(ckpt)]
    assert main([*args, "--compute-dtype", "float32"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["compute_dtype"] == "float32"
    side = (24, 30) if processor else (16, 16)
    images = np.random.default_rng(5).integers(0, 256, (3, *side, 3), dtype=np.uint8)
    config = ServeConfig(
        checkpoint=str(ckpt), mesh="data=2,model=4", port=0, metrics_port=None, max_batch_images=4
    )
    engine = build_engine(config)
    pre = engine.cfg.preprocess
    with BackgroundServer(config, engine=engine) as server:
        with FeatureClient(server.address) as client:
            info = client.model_info()
            extra = [k for k in ("register_tokens", "pre_projection")
                     if wire.OUTPUT_KINDS[k] in info.outputs]
            got = client.embed(
                list(images),
                outputs=["pooled", "patch_tokens", *extra],
                layers=[-1],
                normalize_patches=normed,
            )
    assert info.model.compute_dtype == "float32" and got.model.compute_dtype == "float32"
    if processor:
        import transformers
        from PIL import Image

        assert not pre.keep_aspect and pre.resize == 20
        theirs = transformers.AutoImageProcessor.from_pretrained(tmp_path / "hf")
        pixels = theirs(images=[Image.fromarray(im) for im in images], return_tensors="np")[
            "pixel_values"].transpose(0, 2, 3, 1)
    else:  # the contract at the model's own size: no resize, no crop
        pixels = (images.astype(np.float32) / np.float32(255) - np.float32(pre.mean)) / (
            np.float32(pre.std))
    with torch.no_grad():
        peer = outputs(model, torch.from_numpy(pixels.transpose(0, 3, 1, 2).copy()))
    assert rel_err(got.pooled, peer["pooled"].numpy()) < TOL_F32
    assert rel_err(got.patch_tokens[-1], peer["patch_tokens"].numpy()) < TOL_F32
    assert set(extra) == {k for k in ("register_tokens", "pre_projection") if k in peer}
    for kind in extra:  # served as their own outputs, equal to the source's too
        assert rel_err(got[kind], peer[kind].numpy()) < TOL_F32, kind
    assert info.pooled_dim == got.pooled.shape[1]
