"""The model at any patch grid: position tables resampled as each source does it, sin-cos and
RoPE computed for the grid, against the sources' own forwards at two non-native square sizes
and one non-square size (float32 compute, 1e-5 relative: tests/parity.py).

Sources: Hugging Face ViTModel (and ViT-MSN, ViT-MAE, I-JEPA, DeiT on its layout) /
Dinov2Model / Dinov2WithRegistersModel with ``interpolate_pos_encoding`` (the DINOv2 models always
interpolate), DINOv3 (RoPE), timm with
``dynamic_img_size=True``; the weights are the tiny perturbed models of test_backbones (a 4x4
grid of 4-pixel patches), so each size here is another grid than the table's."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from parity import check_parity, compiled_apply
from peers import perturb, vit_layout_outputs
from test_backbones import HF_CASES, TIMM_CASES, _hf, timm_converted, timm_outputs
from vit22b.model import OutputRequest, apply, get_config, init_params
from vit22b.model.config import ConfigError
from vit22b.model.convert import convert
from vit22b.model.convert_preprocess import PreprocessFlags
from vit22b.model.posemb import resample_table, rope_tables, sincos2d

SIZES = [(24, 24), (12, 12), (16, 28)]  # 6x6 (up), 3x3 (down), 4x7 (non-square) patches


def _pixels(size: tuple[int, int], n: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, *size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("antialias", [False, True])
def test_resampling_is_torchs_bicubic(antialias):
    """The separable weights equal F.interpolate's (the sources' call) at up, down and mixed
    scales, including DINOv2's 37x37 table to 16x16 (518 px -> 224 px)."""
    method = "bicubic_antialias" if antialias else "bicubic"
    rng = np.random.default_rng(0)
    for old, new in [((4, 4), (6, 6)), ((4, 4), (3, 7)), ((37, 37), (16, 16)), ((14, 14), (32, 9))]:
        table = rng.standard_normal((old[0] * old[1], 8)).astype(np.float32)
        grid = torch.from_numpy(table).reshape(1, *old, 8).permute(0, 3, 1, 2)
        ref = F.interpolate(grid, size=new, mode="bicubic", align_corners=False,
                            antialias=antialias)
        ref = ref.permute(0, 2, 3, 1).reshape(-1, 8).numpy()
        ours = resample_table(table, old, new, method)
        assert np.abs(ours - ref).max() < 1e-5 * np.abs(ref).max(), (old, new)
    assert resample_table(table, old, old, method) is table  # the sources' own-grid early exit


HF_GRID_CASES = {  # case: (model class, config class, kwargs, outputs, normed, posemb_resample)
    "vit": ("ViTModel", "ViTConfig", dict(intermediate_size=96),
            partial(vit_layout_outputs, interpolate=True), True, "bicubic"),
    # the models on ViT's layout interpolate only when asked, as ViT does
    **{
        case: (*HF_CASES[case][:3], partial(vit_layout_outputs, interpolate=True),
               HF_CASES[case][4], "bicubic")
        for case in ("vit-msn", "vit-mae", "ijepa", "deit")
    },
    **{
        case: (*HF_CASES[case][:5], resample)
        for case, resample in [
            ("dinov2", "bicubic"),
            ("dinov2-registers", "bicubic_antialias"),
            ("dinov3", "bicubic"),  # RoPE: no table (the field is unused)
        ]
    },
}


@pytest.mark.parametrize("case", list(HF_GRID_CASES))
def test_hf_parity_at_other_grids(case, tmp_path):
    cls_name, config_name, kw, outputs, normed, resample = HF_GRID_CASES[case]
    model = _hf(cls_name, config_name, seed=61 + len(case), **kw)
    if cls_name == "ViTModel":
        model = type(model)(model.config, add_pooling_layer=False).eval()
        perturb(model, seed=61)
    model.save_pretrained(tmp_path / case)
    converted = convert("hf", tmp_path / case)
    assert converted.config.posemb_resample == resample
    for size in SIZES:
        pixels = _pixels(size, seed=size[1])
        with torch.no_grad():
            peer = {k: v.numpy() for k, v in outputs(model, pixels).items()}
        assert peer["patch_tokens"].shape[1] == size[0] * size[1] // 16
        check_parity(f"hf-{case}-{size[0]}x{size[1]}", f"hf {cls_name}", converted,
                     pixels.numpy(), peer, normed)


@pytest.mark.parametrize("case", ["dinov2", "dinov2-reg4", "deit-distilled"])
def test_timm_dynamic_img_size_parity(case, tmp_path):
    name, _ = TIMM_CASES[case]
    # its pretrained_cfg keeps the 518 px of the default tag (not whole 4 px patches): the
    # model's own 16 px, by flags
    model, converted = timm_converted(name, tmp_path / case, 71 + len(case), num_classes=0,
                                      dynamic_img_size=True,
                                      preprocess=PreprocessFlags(resize=16, crop=16))
    assert converted.config.posemb_resample == "bicubic_antialias"
    for size in SIZES:
        pixels = _pixels(size, seed=size[0])
        check_parity(f"timm-{case}-{size[0]}x{size[1]}", f"timm {name}", converted,
                     pixels.numpy(), timm_outputs(model, pixels), True)


def test_hf_dinov2_with_its_518_table_served_at_the_processors_224_crop(tmp_path):
    """A real DINOv2 layout: a 37x37 table (518 px, patch 14) and BitImageProcessor's shorter
    side 256 + centre crop 224. The converter keeps the table and serves 224 (16x16 patches),
    resampled as Dinov2Model does; equal to the source at 224."""
    import transformers

    config = transformers.Dinov2Config(hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                       image_size=518, patch_size=14)
    model = transformers.Dinov2Model(config).eval()
    perturb(model, seed=81)
    model.save_pretrained(tmp_path / "m")
    transformers.BitImageProcessor(
        size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224},
        do_center_crop=True, resample=3,
    ).save_pretrained(tmp_path / "m")
    converted = convert("hf", tmp_path / "m")
    cfg = converted.config
    assert (cfg.image_size, cfg.posemb_grid, cfg.grid, cfg.table_grid) == (224, 37, 16, (37, 37))
    assert (cfg.preprocess.resize, cfg.preprocess.crop) == (256, True)
    assert converted.params["pos_embedding"].shape == (1, 37 * 37 + 1, 48)
    pixels = _pixels((224, 224), n=1)
    with torch.no_grad():
        peer = {k: v.numpy() for k, v in HF_CASES["dinov2"][3](model, pixels).items()}
    check_parity("hf-dinov2-518-table-at-224", "hf Dinov2Model", converted, pixels.numpy(),
                 peer, True)


def test_sincos_and_rope_tables_follow_the_grid():
    """sin-cos: big_vision's posemb_sincos_2d(h, w) layout (x from the column, y from the row);
    RoPE: each axis normalised by its own count (HF get_patches_center_coordinates)."""
    table = sincos2d(2, 3, 8)
    assert table.shape == (6, 8)
    np.testing.assert_allclose(table[4, :2], np.sin([1.0, 1e-4]), rtol=1e-6)  # row 1, col 1
    np.testing.assert_allclose(table[4, 4:6], np.sin([1.0, 1e-4]), rtol=1e-6)
    np.testing.assert_allclose(table[2, 4:6], np.sin([0.0, 0.0]), atol=1e-7)  # row 0, col 2
    from transformers.models.dinov3_vit.modeling_dinov3_vit import get_patches_center_coordinates

    coords = get_patches_center_coordinates(3, 5, torch.float32, "cpu").numpy()
    cos, _ = rope_tables(3, 5, 8, 100.0)
    np.testing.assert_allclose(cos[:, 0], np.cos(2 * np.pi * coords[:, 0]), rtol=1e-6)
    np.testing.assert_allclose(cos[:, 2], np.cos(2 * np.pi * coords[:, 1]), rtol=1e-6)


def test_the_native_model_runs_at_any_grid_and_refuses_partial_patches():
    import jax

    cfg = get_config("vit-22b-tiny/16").replace(compute_dtype="float32")
    params = init_params(cfg, jax.random.key(0))
    images = np.random.default_rng(0).standard_normal((2, 48, 80, 3)).astype(np.float32)
    out = compiled_apply(cfg, params, images, OutputRequest(patch_layers=(-1,)))
    assert out["pooled"].shape == (2, 64) and out["patch_tokens"][3].shape == (2, 15, 64)
    with pytest.raises(ConfigError, match="50x80 pixels is not a whole number of 16x16"):
        apply(cfg, params, np.zeros((1, 50, 80, 3), np.float32), OutputRequest())
    fixed = cfg.replace(posemb_resample="none")
    with pytest.raises(ValueError, match="for a 4x4 grid only"):
        apply(fixed, params, images, OutputRequest())
