"""The served preprocessing equals the source's own processor on real image files.

Each Hugging Face case saves a model (224 px input, a 4x4 grid) and the processor its hub
repositories ship (transformers' own classes and defaults, or the hub's JSON where the class
needs torchvision), converts the folder, and feeds JPEG and PNG files of non-square photo sizes,
written here, both to ``model/pixels.py``'s ``Preprocessor`` (the bytes, as the server decodes
them) and to ``AutoImageProcessor`` (a PIL image of the same file): the normalised tensors must
agree to ``TOL_PIXELS``. The largest difference is recorded (``python benchmarks/parity.py``).

timm's transforms and open_clip's are torchvision's, which does not load beside this torch
(tests/peers.py): their tests compare the configs timm's ``resolve_data_config`` and open_clip's
``PreprocessCfg`` resolve with the served contract, and run the transforms only where a real
torchvision loads.

Where the contract cannot express the source's geometry, the case is marked
``xfail(strict=True)`` with the reason, so that it fails loudly once the contract can.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from parity import record
from peers import import_open_clip, perturb, uses_stand_in
from PIL import Image
from safetensors.torch import save_file
from test_backbones import OPEN_CLIP_CFG, TIMM_SHAPE, timm
from timm.models._hub import save_config_for_hf
from vit22b.model.convert import ConvertError, convert
from vit22b.model.pixels import Preprocessor

TOL_PIXELS = 1e-6  # float32 rounding of (x / 255 - mean) / std; measured: 0 (bit-identical)
IMAGENET = dict(image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
# name -> (width, height); JPEG and PNG, landscape, portrait and 16:9; crop margins 3 mod 4
# (rounded and floored offsets apart): DINOv2's 455 - 224 on 1280x720, CLIP's 299 - 224 on 642x480
IMAGES = {
    "640x480.jpg": (640, 480),
    "480x640.png": (480, 640),
    "1280x720.jpg": (1280, 720),
    "500x333.png": (500, 333),
    "642x480.png": (642, 480),
}
# case -> (model, its config, the processor: a transformers class with its hub settings, or
# the hub's preprocessor_config.json where the class needs torchvision)
HF_CASES = {
    "clip": ("CLIPVisionModel", "CLIPVisionConfig", ("CLIPImageProcessor", {})),
    "dinov2": (  # facebook/dinov2-*: BitImageProcessor, shortest edge 256, crop 224, bicubic
        "Dinov2Model",
        "Dinov2Config",
        (
            "BitImageProcessor",
            dict(
                size={"shortest_edge": 256},
                crop_size={"height": 224, "width": 224},
                resample=3,
                **IMAGENET,
            ),
        ),
    ),
    "siglip": ("SiglipVisionModel", "SiglipVisionConfig", ("SiglipImageProcessor", {})),
    # a file naming its class and nothing else: the class's defaults (CLIP's crop, mean, bicubic)
    "clip-class-defaults": (
        "CLIPVisionModel", "CLIPVisionConfig", {"image_processor_type": "CLIPImageProcessor"}),
    # facebook/deit-*-distilled-patch16-224's file: its int size is a square (DeiT's class), so
    # every image is squashed to 256x256, then centre-cropped (Preprocess.keep_aspect False)
    "deit": (
        "DeiTModel",
        "DeiTConfig",
        {"feature_extractor_type": "DeiTFeatureExtractor", "size": 256, "crop_size": 224,
         "do_center_crop": True, "resample": 3, **IMAGENET},
    ),
    # ViT's class squashes an int size too, then crops where the file asks
    "vit-int-size-and-crop": (
        "ViTModel",
        "ViTConfig",
        {"image_processor_type": "ViTImageProcessor", "size": 256, "crop_size": 224,
         "do_center_crop": True},
    ),
    # the file's default_to_square over its class's: a shortest edge for ViT, a square for CLIP
    "vit-default-to-square-false": (
        "ViTModel",
        "ViTConfig",
        {"image_processor_type": "ViTImageProcessor", "size": 256, "default_to_square": False,
         "do_center_crop": True, "crop_size": 224},
    ),
    "clip-default-to-square-true": (
        "CLIPVisionModel",
        "CLIPVisionConfig",
        {"image_processor_type": "CLIPImageProcessor", "size": 256, "default_to_square": True,
         "crop_size": 224},
    ),
    # CLIP's use_square_size (Kosmos-2's): its class's own 224 edge as a square, the file's
    # size unread
    "clip-use-square-size": (
        "CLIPVisionModel",
        "CLIPVisionConfig",
        {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 256},
         "use_square_size": True, "crop_size": 224},
    ),
    "vit": ("ViTModel", "ViTConfig", ("ViTImageProcessor", {})),
    "dinov3": (  # facebook/dinov3-*-pretrain-lvd1689m's preprocessor_config.json
        "DINOv3ViTModel",
        "DINOv3ViTConfig",
        {
            "image_processor_type": "DINOv3ViTImageProcessorFast",
            "do_resize": True,
            "size": {"height": 224, "width": 224},
            "resample": 2,
            "do_center_crop": None,
            "crop_size": None,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            **IMAGENET,
        },
    ),
}
TORCHVISION_ONLY = ("dinov3",)  # transformers has no PIL backend for its processor


def _photo(width: int, height: int, seed: int) -> np.ndarray:
    """Smooth colour fields, hard edges and sensor noise: what resampling filters differ on."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    fields = [
        120 + 90 * np.sin(x / (9 + 4 * c) + c) * np.cos(y / (13 - 3 * c) - c) for c in range(3)
    ]
    rgb = np.stack(fields, axis=-1)
    rgb[(x // 37 + y // 29) % 5 == 0] *= 0.4  # edges
    return np.clip(rgb + rng.normal(0, 12, rgb.shape), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def image_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("images")
    files = {}
    for seed, (name, (width, height)) in enumerate(IMAGES.items()):
        fmt = "JPEG" if name.endswith(".jpg") else "PNG"
        files[name] = folder / name
        Image.fromarray(_photo(width, height, seed)).save(files[name], fmt, quality=90)
    return files


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """case -> a folder with the model and its processor's preprocessor_config.json."""
    import transformers

    folders: dict[str, Path] = {}

    def build(case: str) -> Path:
        if case not in folders:
            model_cls, config_cls, processor = HF_CASES[case]
            sizes = dict(hidden_size=48, num_hidden_layers=1, num_attention_heads=4)
            sizes.update(image_size=224, patch_size=56)
            if case != "dinov2":  # Dinov2Config sizes its MLP by mlp_ratio
                sizes["intermediate_size"] = 96
            config = getattr(transformers, config_cls)(**sizes)
            folder = folders[case] = tmp_path_factory.mktemp(case)
            getattr(transformers, model_cls)(config).save_pretrained(folder)
            if isinstance(processor, dict):
                (folder / "preprocessor_config.json").write_text(json.dumps(processor))
            else:
                name, settings = processor
                getattr(transformers, name)(**settings).save_pretrained(folder)
        return folders[case]

    return build


def _torchvision_loads() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # absent, or built for another torch
        return False
    return True


@pytest.mark.parametrize(
    "case, image",
    [(c, i) for c in HF_CASES for i in IMAGES],
)
def test_hf_image_processor_on_image_files(case, image, hf_folder, image_files):
    """Served pixels against the source's processor. transformers' centre crop floors the
    offset ((455 - 224) // 2 = 115 columns on the 16:9 file at DINOv2's 256 -> 224) where
    torchvision, timm and open_clip round it (116): a converted processor's contract floors
    (Preprocess.crop_offset), once an xfail here."""
    import transformers

    if case in TORCHVISION_ONLY and not _torchvision_loads():
        pytest.skip(
            f"transformers' {case} image processor runs only on torchvision, which does not load "
            "beside this torch (tests/peers.py); test_dinov3_processor_values compares its "
            "preprocessor_config.json with the served contract instead"
        )
    folder = hf_folder(case)
    processor = transformers.AutoImageProcessor.from_pretrained(folder)
    source = f"hf {type(processor).__name__.removesuffix('Pil')}"
    try:
        served = convert("hf", folder).config
    except ConvertError as err:
        record({"processor": case, "source": source, "image": image, "refused": str(err)})
        raise
    ours = Preprocessor(served).load(image_files[image].read_bytes())
    with Image.open(image_files[image]) as pil:
        theirs = processor(images=pil, return_tensors="np")["pixel_values"][0]
    theirs = np.asarray(theirs).transpose(1, 2, 0)
    assert ours.shape == theirs.shape == (224, 224, 3)
    diff = float(np.abs(ours - theirs).max())
    record({"processor": case, "source": source, "image": image, "max_abs": diff})
    assert diff <= TOL_PIXELS, f"{case} on {image}: served pixels differ by up to {diff:.3g}"


# processor file -> the refusal: a geometry the contract cannot serve, as transformers' class
# reads the file (an int size is a shortest edge for SigLIP's), and files that leave to an
# unknown class what only it knows
REFUSED_PROCESSORS = {
    "siglip-int-size": (
        {"image_processor_type": "SiglipImageProcessor", "size": 224},
        "resizes the shorter side to 224 and does not crop", (224, 298)),
    # a null is None to transformers: a flag off (no crop: a non-square input here, and DeiT's
    # 256 square uncropped), a value it cannot preprocess with
    "clip-null-crop-flag": (
        {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 224},
         "do_center_crop": None, "crop_size": 224},
        "resizes the shorter side to 224 and does not crop", (224, 298)),
    "deit-null-crop-flag": (
        {"image_processor_type": "DeiTImageProcessor", "size": 256, "do_center_crop": None,
         "crop_size": 224},
        "gives 256x256 inputs, not a whole number of 56x56 patches", (256, 256)),
    "vit-null-mean": (
        {"image_processor_type": "ViTImageProcessor", "image_mean": None},
        "image_mean is null, which ViTImageProcessor cannot preprocess with", None),
    "vit-crop-without-size": (
        {"image_processor_type": "ViTImageProcessor", "do_center_crop": True},
        "do_center_crop with no crop_size", None),
    "unknown-class": (
        {"image_processor_type": "MysteryImageProcessor", "size": 224, "resample": 3,
         "do_center_crop": False, **IMAGENET},
        "'MysteryImageProcessor' is not one this converter reads .*; give the preprocessing "
        "whole instead", None),
}


@pytest.mark.parametrize("case", list(REFUSED_PROCESSORS))
def test_a_processor_file_is_read_as_its_class_reads_it(case, tmp_path, image_files):
    """Read as a square (as before), SigLIP's int size would serve other pixels than
    transformers gives for every non-square image, and nulls read as absent took the class's
    default where transformers reads None: refused naming the geometry, as transformers' own
    processor shows it on a 640x480 file (a 224x298 input, a 256x256 one)."""
    import transformers

    processor, message, shape = REFUSED_PROCESSORS[case]
    config = transformers.ViTConfig(hidden_size=48, num_hidden_layers=1, num_attention_heads=4,
                                    intermediate_size=96, image_size=224, patch_size=56)
    transformers.ViTModel(config).save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(processor))
    with pytest.raises(ConvertError, match=message):
        convert("hf", tmp_path)
    if shape is not None:
        theirs = transformers.AutoImageProcessor.from_pretrained(tmp_path)
        with Image.open(image_files["640x480.jpg"]) as pil:
            pixels = theirs(images=pil, return_tensors="np")["pixel_values"]
        assert pixels.shape[2:] == shape


@pytest.mark.parametrize("name", ["LevitImageProcessor", "PoolFormerImageProcessor"])
def test_a_processor_class_not_read_here_is_served_only_from_the_flags(name, tmp_path):
    """Their own steps (LeViT's 256/224 shortest edge, PoolFormer's crop_pct) are no keys the
    converter reads: a file saved by transformers itself names every key, and was served with
    pixels up to 3.8 off. Refused; every preprocessing flag given, the flags are served."""
    import transformers
    from vit22b.model.convert_preprocess import PreprocessFlags

    config = transformers.ViTConfig(hidden_size=48, num_hidden_layers=1, num_attention_heads=4,
                                    intermediate_size=96, image_size=224, patch_size=56)
    transformers.ViTModel(config).save_pretrained(tmp_path)
    getattr(transformers, name)().save_pretrained(tmp_path)
    with pytest.raises(ConvertError, match=f"image processor '{name}' is not one this converter "
                                           "reads"):
        convert("hf", tmp_path)
    flags = PreprocessFlags(resize=256, crop=224, interpolation="bicubic",
                            mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    converted = convert("hf", tmp_path, preprocess=flags)
    assert converted.config.preprocess.resize == 256 and converted.config.preprocess.keep_aspect
    assert any(f"'{name}' is not one this converter reads" in note for note in converted.notes)


def test_dinov3_processor_values(hf_folder):
    """DINOv3's processor (torchvision only) by its preprocessor_config.json: the served
    contract must be its square 224 resize (no crop), bilinear, ImageNet mean/std."""
    served = convert("hf", hf_folder("dinov3")).config.preprocess
    assert (served.resize, served.interpolation, served.crop) == (224, "bilinear", False)
    assert list(served.mean) == IMAGENET["image_mean"] and list(served.std) == IMAGENET["image_std"]


# ------------------------------------------------------------------------------------------
# timm and open_clip: torchvision transforms
# ------------------------------------------------------------------------------------------

TIMM_ARCHS = (
    "vit_base_patch16_224",  # augreg: crop_pct 0.9, mean/std 0.5
    "vit_base_patch14_dinov2",  # crop_pct 1.0, ImageNet mean/std
    "vit_base_patch16_siglip_224",
    "vit_base_patch16_clip_quickgelu_224",  # OpenAI mean/std
    "vit_base_patch16_dinov3",  # eva.py's DINOv3 port: 256 px, crop_pct 1.0, ImageNet mean/std
)


def _timm_folder(folder: Path, name: str) -> tuple[Path, dict]:
    """A tiny model saved as timm's hub keeps it; returns its resolved data config."""
    model = timm.create_model(name, pretrained=False, **TIMM_SHAPE, num_classes=0).eval()
    perturb(model, seed=81)
    folder.mkdir()
    save_file(model.state_dict(), str(folder / "model.safetensors"))
    save_config_for_hf(model, str(folder / "config.json"))
    pretrained_cfg = json.loads((folder / "config.json").read_text())["pretrained_cfg"]
    return folder, timm.data.resolve_data_config(pretrained_cfg=pretrained_cfg)


@pytest.mark.parametrize("name", TIMM_ARCHS)
def test_timm_data_config_is_the_served_contract(name, tmp_path):
    """timm's eval transform is Resize(floor(size / crop_pct)) (the shorter side), CenterCrop,
    ToTensor, Normalize: the served contract is that, with the resolved values."""
    folder, data = _timm_folder(tmp_path / "m", name)
    served = convert("timm", folder).config
    assert data["crop_mode"] == "center"
    assert served.image_size == data["input_size"][-1] == data["input_size"][-2]
    assert served.preprocess.resize == math.floor(data["input_size"][-1] / data["crop_pct"])
    assert served.preprocess.interpolation == data["interpolation"]
    assert served.preprocess.mean == tuple(data["mean"])
    assert served.preprocess.std == tuple(data["std"])


@pytest.mark.parametrize("name", TIMM_ARCHS[:2])
def test_timm_transforms_on_image_files(name, tmp_path, image_files):
    if uses_stand_in():
        pytest.skip(
            "timm's transforms are torchvision's, which does not load beside this torch "
            "(tests/peers.py stands in for it); test_timm_data_config_is_the_served_contract "
            "compares the resolved config with the served contract instead"
        )
    folder, data = _timm_folder(tmp_path / "m", name)
    served = convert("timm", folder).config
    transform = timm.data.create_transform(**data, is_training=False)
    for image, path in image_files.items():
        ours = Preprocessor(served).load(path.read_bytes())
        with Image.open(path) as pil:
            theirs = transform(pil.convert("RGB")).numpy().transpose(1, 2, 0)
        diff = float(np.abs(ours - theirs).max())
        record(
            {"processor": name, "source": "timm create_transform", "image": image, "max_abs": diff}
        )
        assert diff <= TOL_PIXELS, f"{name} on {image}: served pixels differ by up to {diff:.3g}"


def test_open_clip_preprocess_cfg_is_the_served_contract(tmp_path):
    """open_clip's eval transform ('shortest': Resize(size), CenterCrop(size), Normalize) by the
    PreprocessCfg its own create_model resolves from open_clip_config.json."""
    import torch

    open_clip = import_open_clip()
    from open_clip.transform import PreprocessCfg, merge_preprocess_dict

    folder = tmp_path / "oc"
    folder.mkdir()
    torch.save(
        open_clip.model.CLIP(**OPEN_CLIP_CFG).state_dict(), folder / "open_clip_pytorch_model.bin"
    )
    preprocess = {"mean": [0.4, 0.45, 0.5], "std": [0.2, 0.25, 0.3], "interpolation": "bilinear"}
    (folder / "open_clip_config.json").write_text(
        json.dumps({"model_cfg": OPEN_CLIP_CFG, "preprocess_cfg": preprocess})
    )
    model = open_clip.create_model(f"local-dir:{folder}")
    cfg = PreprocessCfg(
        **merge_preprocess_dict(PreprocessCfg(), open_clip.get_model_preprocess_cfg(model))
    )
    served = convert("open_clip", folder).config
    size = cfg.size if isinstance(cfg.size, int) else cfg.size[0]
    assert cfg.resize_mode == "shortest" and cfg.size in (size, (size, size))
    assert served.image_size == size and served.preprocess.resize == size
    assert served.preprocess.interpolation == cfg.interpolation
    assert served.preprocess.mean == tuple(cfg.mean) and served.preprocess.std == tuple(cfg.std)
