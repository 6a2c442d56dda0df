"""What `vit22b convert` reads besides the tensors: the preprocessing (the source's files, its
defaults, or the flags --mean/--std/--resize/--crop/--interpolation over either, each value
checked naming where it came from), and the refusals of what it cannot serve: an unsupported
family names what it has, a config that contradicts the weights names both values."""

from __future__ import annotations

import json
import os
import re

import jax
import numpy as np
import pytest
import torch
from peers import import_open_clip, perturb
from safetensors.torch import save_file
from test_backbones import OPEN_CLIP_CFG, TIMM_SHAPE, _hf, timm
from timm.models._hub import save_config_for_hf
from vit22b.clients.cli import main
from vit22b.model import checkpoint as ckpt
from vit22b.model.config import Preprocess
from vit22b.model.convert import ConvertError, Hints, convert
from vit22b.model.convert_common import SHARD_INDEX, unpacked_size
from vit22b.model.convert_preprocess import PreprocessFlags

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


def _clip_folder(path, processor=None):
    """A tiny CLIPVisionModel (16x16 input) saved by transformers, with ``processor``'s file."""
    _hf("CLIPVisionModel", "CLIPVisionConfig", seed=71, intermediate_size=96).save_pretrained(path)
    if processor is not None:
        processor.save_pretrained(path)
    return path


def _clip_processor(**kw):
    import transformers

    kw = {"size": {"shortest_edge": 18}, "crop_size": {"height": 16, "width": 16}, **kw}
    return transformers.CLIPImageProcessor(**kw)


# ------------------------------------------------------------------------------------------
# where the preprocessing comes from
# ------------------------------------------------------------------------------------------


def test_the_processor_file_decides_and_its_absence_gives_the_sources_defaults(tmp_path):
    with_file = convert("hf", _clip_folder(tmp_path / "a", _clip_processor()))
    assert with_file.preprocess_from == "preprocessor_config.json"
    # transformers floors its centre crop's offset (both backends): the contract too
    assert with_file.config.preprocess == Preprocess(18, "bicubic", OPENAI_MEAN, OPENAI_STD,
                                                     crop_offset="floor")
    assert "preprocessing from preprocessor_config.json" in with_file.notes

    bare = convert("hf", _clip_folder(tmp_path / "b"))
    assert bare.preprocess_from == "hf defaults (no preprocessor_config.json)"
    assert bare.config.preprocess == Preprocess(16, "bilinear", (0.5,) * 3, (0.5,) * 3, crop=False)
    supplied = convert("hf", tmp_path / "b", preprocess=PreprocessFlags(mean=(0.1, 0.2, 0.3)))
    assert (
        supplied.preprocess_from == "flags (--mean) over hf defaults (no preprocessor_config.json)"
    )
    assert supplied.config.preprocess.mean == (0.1, 0.2, 0.3)


def test_flags_override_the_files_and_are_recorded_in_the_checkpoint(tmp_path, capsys):
    folder = _clip_folder(tmp_path / "m", _clip_processor())
    out = tmp_path / "ckpt"
    flags = ["--mean", "0.1", "0.2", "0.3", "--std", "0.4", "0.5", "0.6"]
    flags += ["--resize", "20", "--interpolation", "bilinear", "--crop", "16"]
    args = ["convert", "--from", "hf", "--input", str(folder), "--out", str(out), *flags]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["preprocess_from"] == "flags"  # all five given: nothing left of the file's
    meta = ckpt.read_metadata(out)
    assert meta.config.preprocess == Preprocess(20, "bilinear", (0.1, 0.2, 0.3), (0.4, 0.5, 0.6),
                                                crop_offset="floor")
    assert summary["preprocess_hash"] == meta.preprocess_hash
    assert "preprocessing from flags" in meta.notes

    assert main([*args[:7], "--overwrite", "--std", "0.4", "0.5", "0.6"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["preprocess_from"] == "flags (--std) over preprocessor_config.json"
    assert ckpt.read_metadata(out).config.preprocess == Preprocess(
        18, "bicubic", OPENAI_MEAN, (0.4, 0.5, 0.6), crop_offset="floor"
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(std=(0.2, 0.0, 0.3)), "std (0.2, 0.0, 0.3) (--std): needs 3 positive numbers"),
        (dict(std=(0.2, -1.0, 0.3)), "needs 3 positive numbers, one per channel R G B"),
        (dict(mean=(0.1, float("nan"), 0.3)), "mean (0.1, nan, 0.3) (--mean): needs 3 finite"),
        (dict(mean=(0.1, 0.2)), "mean (0.1, 0.2) (--mean): needs 3 finite numbers"),
        (dict(resize=0), "resize 0 (--resize): needs a positive whole number"),
        (dict(interpolation="lanczos"), "interpolation 'lanczos' (--interpolation) is not one"),
        (dict(crop=18), "--crop gives 18x18 inputs, not a whole number of 4x4 patches"),
        (
            dict(crop=20),
            "resize 18 (preprocessor_config.json) is smaller than the crop 20 (--crop)",
        ),
        (dict(resize=12), "resize 12 (--resize) is smaller than the crop 16 (preprocessor_config"),
        (dict(resize=15, crop=16), "resize 15 (--resize) is smaller than the crop 16 (--crop)"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(flags, message, tmp_path):
    folder = _clip_folder(tmp_path / "m", _clip_processor())
    with pytest.raises(ConvertError, match=re.escape(message)):
        convert("hf", folder, preprocess=PreprocessFlags(**flags))


def test_a_bad_flag_on_the_command_line_is_one_line_and_exit_2(tmp_path, capsys):
    folder = _clip_folder(tmp_path / "m")
    args = ["convert", "--from", "hf", "--input", str(folder), "--out", str(tmp_path / "c")]
    capsys.readouterr()
    assert main([*args, "--std", "0.2", "0", "0.3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "vit22b convert: std (0.2, 0.0, 0.3) (--std): needs 3 positive numbers, one per "
        "channel R G B"
    )
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--interpolation", "lanczos"])
    assert exit_.value.code == 2
    assert "invalid choice: 'lanczos'" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    "file, refused, rescue",
    [
        (dict(resample=1), "interpolation 'lanczos' (preprocessor_config.json)", "--interpolation"),
        (
            dict(crop_size={"height": 18, "width": 18}),
            "preprocessor_config.json gives 18x18 inputs, not a whole number of 4x4 patches",
            "--crop",
        ),
        (
            dict(image_std=[0.2, 0.0, 0.3]),
            "std (0.2, 0.0, 0.3) (preprocessor_config.json)",
            "--std",
        ),
    ],
)
def test_what_a_file_says_and_cannot_be_served_is_refused_unless_a_flag_replaces_it(
    file, refused, rescue, tmp_path
):
    folder = _clip_folder(tmp_path / "m", _clip_processor(**file))
    with pytest.raises(ConvertError, match=re.escape(refused)):
        convert("hf", folder)
    flag = {
        "--interpolation": dict(interpolation="bicubic"),
        "--crop": dict(crop=16),
        "--std": dict(std=(0.2, 0.3, 0.3)),
    }[rescue]
    converted = convert("hf", folder, preprocess=PreprocessFlags(**flag))
    assert converted.preprocess_from == f"flags ({rescue}) over preprocessor_config.json"


def test_a_square_resize_is_served_squashed_unless_resize_chooses_a_centre_crop(tmp_path):
    """ViTImageProcessor / SigLIP resize every image to HxW, ignoring the aspect ratio: served so
    (Preprocess.crop False); --resize serves the shorter side resized and a centre crop."""
    import transformers

    processor = transformers.ViTImageProcessor(size={"height": 16, "width": 16})
    folder = _clip_folder(tmp_path / "m", processor)
    squashed = convert("hf", folder).config.preprocess
    assert squashed == Preprocess(16, "bilinear", (0.5,) * 3, (0.5,) * 3, crop=False)
    converted = convert("hf", folder, preprocess=PreprocessFlags(resize=18))
    assert converted.config.preprocess == Preprocess(18, "bilinear", (0.5,) * 3, (0.5,) * 3,
                                                     crop_offset="floor")  # transformers' crop
    assert any("served: --resize 18, centre crop" in note for note in converted.notes)


def _timm_folder(path, name="vit_base_patch16_224", **kw):
    model = timm.create_model(name, pretrained=False, **TIMM_SHAPE, **kw).eval()
    perturb(model, seed=72)
    path.mkdir()
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors")
    )
    save_config_for_hf(model, str(path / "config.json"))
    return path


def _edit_json(file, edit) -> None:
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))


def test_timm_squash_before_a_crop_and_open_clip_squash_are_served(tmp_path):
    """timm's crop_mode 'squash' resizes both sides to floor(input / crop_pct), then centre-crops
    (torchvision's Resize of a pair, CenterCrop): keep_aspect False; --resize N chooses the
    shorter side instead."""
    folder = _timm_folder(tmp_path / "t", num_classes=0)
    _edit_json(folder / "config.json", lambda c: c["pretrained_cfg"].update(crop_mode="squash"))
    squashed = convert("timm", folder)
    assert squashed.config.image_size == 16
    served = squashed.config.preprocess
    assert (served.resize, served.crop, served.keep_aspect, served.crop_offset) == (
        17, True, False, "round")
    served = convert("timm", folder, preprocess=PreprocessFlags(resize=18)).config.preprocess
    assert (served.resize, served.crop, served.keep_aspect) == (18, True, True)
    _edit_json(folder / "config.json", lambda c: c["pretrained_cfg"].update(crop_pct=1.0))
    served = convert("timm", folder).config.preprocess  # crop_pct 1: both sides, no crop
    assert (served.resize, served.crop, served.keep_aspect) == (16, False, True)

    open_clip = import_open_clip()
    oc = tmp_path / "oc"
    oc.mkdir()
    torch.save(
        open_clip.model.CLIP(**OPEN_CLIP_CFG).state_dict(), oc / "open_clip_pytorch_model.bin"
    )
    config = {"model_cfg": OPEN_CLIP_CFG, "preprocess_cfg": {"resize_mode": "squash"}}
    (oc / "open_clip_config.json").write_text(json.dumps(config))
    assert not convert("open_clip", oc).config.preprocess.crop  # squash: both sides resized
    assert convert("open_clip", oc, preprocess=PreprocessFlags(resize=16)).config.preprocess.crop


# ------------------------------------------------------------------------------------------
# unsupported families and contradicting configs
# ------------------------------------------------------------------------------------------


def test_a_timm_model_that_is_not_a_vision_transformer_names_what_it_has(tmp_path):
    model = timm.create_model("convnext_atto", pretrained=False)
    tmp_path.joinpath("cn").mkdir()
    save_file(model.state_dict(), str(tmp_path / "cn" / "model.safetensors"))
    save_config_for_hf(model, str(tmp_path / "cn" / "config.json"))
    with pytest.raises(
        ConvertError,
        match=r"timm convnext_atto checkpoint: not a timm VisionTransformer .*its keys begin: "
        r"head\.fc\.bias, head\.fc\.weight, .*stages\.0\.blocks\.0\.conv_dw",
    ):
        convert("timm", tmp_path / "cn")


def test_an_open_clip_checkpoint_of_a_text_tower_alone_says_so(tmp_path):
    open_clip = import_open_clip()
    state = open_clip.model.CLIP(**OPEN_CLIP_CFG).state_dict()
    tmp_path.joinpath("oc").mkdir()
    text = {k: v for k, v in state.items() if not k.startswith("visual.")}
    torch.save(text, tmp_path / "oc" / "open_clip_pytorch_model.bin")
    with pytest.raises(
        ConvertError,
        match=r"open_clip checkpoint: a text tower only \(token_embedding.weight, ...\): no "
        r"visual\.\* keys nor a bare tower's conv1\.weight; its keys begin: ln_final\.bias",
    ):
        convert("open_clip", tmp_path / "oc", Hints(mlp="gelu"))


def test_a_timm_config_that_contradicts_the_weights_names_both(tmp_path):
    folder = _timm_folder(tmp_path / "t", num_classes=12)

    def edit(c):
        c["num_classes"] = 1000
        c["model_args"]["depth"] = 12

    _edit_json(folder / "config.json", edit)
    with pytest.raises(ConvertError) as err:
        convert("timm", folder)
    assert str(err.value) == (
        "timm vit_base_patch16_224 checkpoint: config.json contradicts the weights: "
        "num_classes: config.json has 1000, the weights have 12; model_args.depth: config.json "
        "has 12, the weights have 2"
    )


def test_an_open_clip_config_that_contradicts_the_weights_names_both(tmp_path):
    open_clip = import_open_clip()
    tmp_path.joinpath("oc").mkdir()
    torch.save(
        open_clip.model.CLIP(**OPEN_CLIP_CFG).state_dict(),
        tmp_path / "oc" / "open_clip_pytorch_model.bin",
    )
    vision = {**OPEN_CLIP_CFG["vision_cfg"], "layers": 12, "width": 768}
    config = {"model_cfg": {**OPEN_CLIP_CFG, "vision_cfg": vision, "embed_dim": 512}}
    (tmp_path / "oc" / "open_clip_config.json").write_text(json.dumps(config))
    with pytest.raises(ConvertError) as err:
        convert("open_clip", tmp_path / "oc")
    assert str(err.value) == (
        "open_clip checkpoint: open_clip_config.json contradicts the weights: vision_cfg.width: "
        "open_clip_config.json has 768, the weights have 48; vision_cfg.layers: "
        "open_clip_config.json has 12, the weights have 2; the MLP width (vision_cfg.mlp_ratio "
        "x width): open_clip_config.json has 1920, the weights have 120; embed_dim: "
        "open_clip_config.json has 512, the weights have 24"
    )


# ------------------------------------------------------------------------------------------
# hostile files beside and in place of the weights
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, message",
    [
        (("model_args", "num_heads"), "four", 'model_args.num_heads is "four", not a whole number'),
        (("model_args", "num_heads"), 2.5, "model_args.num_heads is 2.5, not a whole number > 0"),
        (("model_args", "depth"), True, "model_args.depth is true, not a whole number > 0"),
        (("model_args", "img_size"), [16], r"model_args.img_size is \[16\], not a whole number"),
        (("model_args", "norm_layer"), ["x"], r'model_args.norm_layer is \["x"\], not a string'),
        (("model_args",), [1, 2], r"model_args is \[1, 2\], not a JSON object"),
        (("pretrained_cfg", "input_size"), 16, "pretrained_cfg.input_size is 16, not a list of 3"),
        (("pretrained_cfg", "crop_pct"), 0, "pretrained_cfg.crop_pct is 0, not a finite number >"),
        (("pretrained_cfg", "mean"), 0.5, "pretrained_cfg.mean is 0.5, not a list of finite"),
        (("pretrained_cfg", "std"), [1e400, 1, 1], r"pretrained_cfg.std is \[Infinity, 1, 1\]"),
        (("architecture",), 5, "architecture is 5, not a string"),
    ],
)
def test_a_timm_config_value_of_the_wrong_kind_is_refused_naming_file_key_and_value(
    key, value, message, tmp_path
):
    """A value the converter reads, of another kind than it reads (a string for a count, true for
    a depth, a number for a list): refused before use, not a traceback nor read as something
    else (true as 1, 2.5 heads as 2)."""
    folder = _timm_folder(tmp_path / "t", num_classes=0)

    def edit(config):
        *parents, last = key
        for name in parents:
            config = config[name]
        config[last] = value

    _edit_json(folder / "config.json", edit)
    with pytest.raises(ConvertError, match=rf"^{re.escape(str(folder))}/config.json: {message}"):
        convert("timm", folder)


def test_hf_and_open_clip_config_values_of_the_wrong_kind_are_refused(tmp_path):
    folder = _clip_folder(tmp_path / "c", _clip_processor())
    for file, edit, message in (
        ("config.json", lambda c: c.update(layer_norm_eps=True), "layer_norm_eps is true, not a"),
        ("config.json", lambda c: c.update(hidden_act=["gelu"]), r'hidden_act is \["gelu"\], not'),
        ("config.json", lambda c: c.update(num_attention_heads="4"), 'num_attention_heads is "4"'),
        ("preprocessor_config.json", lambda c: c.update(image_mean="x"), 'image_mean is "x", not'),
        ("preprocessor_config.json", lambda c: c.update(size={"shortest_edge": "18"}),
         r'size is \{"shortest_edge": "18"\}, not a whole number > 0, or an object of them'),
        ("preprocessor_config.json", lambda c: c.update(do_resize="no"), 'do_resize is "no", not'),
    ):
        original = (folder / file).read_text()
        _edit_json(folder / file, edit)
        with pytest.raises(ConvertError, match=rf"^{re.escape(str(folder / file))}: {message}"):
            convert("hf", folder)
        (folder / file).write_text(original)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ConvertError, match=r"config.json: the file is \[1, 2\], not a JSON object"):
        convert("hf", folder)

    open_clip = import_open_clip()
    oc = tmp_path / "oc"
    oc.mkdir()
    torch.save(
        open_clip.model.CLIP(**OPEN_CLIP_CFG).state_dict(), oc / "open_clip_pytorch_model.bin"
    )
    for config, message in (
        ({"model_cfg": {**OPEN_CLIP_CFG, "quick_gelu": "yes"}}, 'model_cfg.quick_gelu is "yes"'),
        ({"model_cfg": {**OPEN_CLIP_CFG, "vision_cfg": 3}}, "model_cfg.vision_cfg is 3, not a"),
        ({"model_cfg": OPEN_CLIP_CFG, "preprocess_cfg": {"mean": 0.5}},
         "preprocess_cfg.mean is 0.5, not a list of finite numbers"),
        ({"model_cfg": {**OPEN_CLIP_CFG, "vision_cfg": {
            **OPEN_CLIP_CFG["vision_cfg"], "norm_kwargs": {"eps": "1e-5"}}}},
         'model_cfg.vision_cfg.norm_kwargs.eps is "1e-5", not a finite number > 0'),
    ):
        (oc / "open_clip_config.json").write_text(json.dumps(config))
        with pytest.raises(ConvertError, match=rf"open_clip_config.json: {message}"):
            convert("open_clip", oc)


def test_a_shard_index_must_name_files_in_its_own_folder(tmp_path):
    """And every tensor it names must be in its shards; it is read where no model.safetensors
    is beside it (transformers' order: a single file beside an index wins)."""
    from safetensors import safe_open

    folder = _clip_folder(tmp_path / "c")
    (tmp_path / "other.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    (folder / "model.safetensors").rename(folder / "shard.safetensors")
    index = folder / "model.safetensors.index.json"
    for text, message in (
        ("{oops", "not valid JSON"),
        ("[1]", "holds no weight_map, an object of tensor names to shard files"),
        ("{}", "holds no weight_map, an object of tensor names to shard files"),
        (json.dumps({"weight_map": {"a": "../other.safetensors"}}),
         "weight_map names '../other.safetensors', not a .safetensors file in its folder"),
        (json.dumps({"weight_map": {"a": 5}}),
         "weight_map names 5, not a .safetensors file in its folder"),
    ):
        index.write_text(text)
        with pytest.raises(ConvertError, match=rf"^{re.escape(str(index))}: {message}"):
            convert("hf", folder)
    with safe_open(folder / "shard.safetensors", "np") as f:
        weight_map = dict.fromkeys(f.keys(), "shard.safetensors")
    index.write_text(json.dumps({"weight_map": {**weight_map, "a": "shard.safetensors"}}))
    with pytest.raises(ConvertError, match=r"names tensors no shard holds \('a'\)"):
        convert("hf", folder)
    index.write_text(json.dumps({"weight_map": weight_map}))
    assert convert("hf", folder).config.depth == 2
    (folder / "model.safetensors").write_bytes(b"not read")  # beside the index, it is read
    with pytest.raises(ConvertError, match="model.safetensors: cannot read weights"):
        convert("hf", folder)


def test_a_shard_index_is_read_by_the_importers_that_read_one_and_whole(tmp_path):
    """An outside tester's finds: timm's importer read a Hugging Face shard index beside a
    timm checkpoint (timm's loader reads none: another model, silently); a shard passed alone
    was "not a supported vision model", the index passed alone "unknown weight format";
    an index nested 100,000 levels deep ended in a RecursionError."""
    from safetensors import safe_open

    model = timm.create_model("vit_base_patch16_224", pretrained=False, **TIMM_SHAPE).eval()
    folder = tmp_path / "timm"
    folder.mkdir()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    clip = _clip_folder(tmp_path / "hf")
    (clip / "model.safetensors").rename(clip / "model-00001-of-00001.safetensors")
    with safe_open(clip / "model-00001-of-00001.safetensors", "np") as f:
        weight_map = dict.fromkeys(f.keys(), "model-00001-of-00001.safetensors")
    (clip / SHARD_INDEX).write_text(json.dumps({"weight_map": weight_map}))
    for name in (SHARD_INDEX, "model-00001-of-00001.safetensors"):
        (folder / name).write_bytes((clip / name).read_bytes())
    want = convert("timm", folder / "pytorch_model.bin", Hints(heads=4)).params
    got = convert("timm", folder, Hints(heads=4)).params  # the .bin, not the index
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, got, want))

    whole = convert("hf", clip).params
    alone = convert("hf", clip / SHARD_INDEX).params  # the index names its shards
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, alone, whole))
    with pytest.raises(ConvertError, match="model-00001-of-00001.safetensors: one shard of the "
                       f"checkpoint its folder's {re.escape(SHARD_INDEX)} names: convert the "
                       "folder"):
        convert("hf", clip / "model-00001-of-00001.safetensors")
    deep = "[" * 100_000 + "]" * 100_000
    (clip / SHARD_INDEX).write_text('{"weight_map": ' + deep + "}")
    with pytest.raises(ConvertError, match="nested over 64 levels deep"):
        convert("hf", clip)
    (clip / "config.json").write_text("[" * 70 + "]" * 70)
    with pytest.raises(ConvertError, match="config.json: nested over 64 levels deep"):
        convert("hf", clip)


def test_a_pipe_or_device_in_place_of_a_file_is_refused_not_waited_on(tmp_path):
    """A FIFO named config.json or model.safetensors blocked the converter for ever, a
    config.json linked to /dev/zero filled the memory: each is refused unread."""
    for name in ("config.json", "model.safetensors.index.json", "model.safetensors"):
        folder = _clip_folder(tmp_path / name)
        (folder / name).unlink(missing_ok=True)
        if name.endswith(".index.json"):  # read where no model.safetensors is (transformers')
            (folder / "model.safetensors").unlink()
        os.mkfifo(folder / name)
        with pytest.raises(ConvertError, match=rf"{re.escape(name)}: not a regular file"):
            convert("hf", folder)
    folder = _clip_folder(tmp_path / "zero")
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to("/dev/zero")
    with pytest.raises(ConvertError, match="config.json: not a regular file"):
        convert("hf", folder)


class _RunsCode:
    def __reduce__(self):  # a harmless call, named by its module (print is rebound by ray)
        return (os.getpid, ())


def test_weights_that_are_integers_or_pickled_objects_are_refused(tmp_path):
    model = timm.create_model("vit_base_patch16_224", pretrained=False, **TIMM_SHAPE).eval()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    for dtype in (torch.int8, torch.bool):
        folder = tmp_path / str(dtype).removeprefix("torch.")
        folder.mkdir()
        weights = {**state, "blocks.0.mlp.fc1.weight": state["blocks.0.mlp.fc1.weight"].to(dtype)}
        save_file(weights, str(folder / "model.safetensors"))
        with pytest.raises(ConvertError, match=rf"key 'blocks.0.mlp.fc1.weight' holds "
                                               rf"{folder.name} values, not floating point"):
            convert("timm", folder, Hints(heads=4))
    torch.save({**state, "extra": _RunsCode()}, tmp_path / "pickled.pth")
    called = rf"\({os.getpid.__module__}\.getpid\)"
    with pytest.raises(ConvertError, match=rf"pickled.pth: holds pickled Python objects besides "
                                           rf"tensors {called}, which are never loaded"):
        convert("timm", tmp_path / "pickled.pth", Hints(heads=4))


def test_training_checkpoints_are_read_as_timm_and_open_clip_read_them(tmp_path):
    """timm's train.py (checkpoint-N.pth.tar: the weights under 'state_dict', the EMA's under
    'state_dict_ema', beside the run's argparse Namespace, the epoch and the optimizer) and
    open_clip's training (epoch_N.pt: 'state_dict' with DistributedDataParallel's 'module.'
    keys) were refused: '.tar' an unknown format, 'epoch' not a tensor. Their weights are read
    as those libraries' own loaders read them, the EMA's first, with a note."""
    import argparse

    def params(path, source, hints=None):
        converted = convert(source, path, hints or Hints(heads=4))
        return jax.tree.leaves(converted.params), converted.notes

    model = timm.create_model("vit_base_patch16_224", pretrained=False, **TIMM_SHAPE).eval()
    plain = {k: v.contiguous() for k, v in model.state_dict().items()}
    perturb(model, seed=5)
    ema = {k: v.contiguous() for k, v in model.state_dict().items()}
    optimizer = {"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 0.1,
                                                                              "params": [0]}]}
    run = {"epoch": 3, "arch": "vit_base_patch16_224", "version": 2, "metric": 71.5,
           "args": argparse.Namespace(lr=0.1, model="vit_base_patch16_224"),
           "optimizer": optimizer}
    torch.save(plain, tmp_path / "plain.pth")
    torch.save(ema, tmp_path / "ema.pth")
    torch.save({**run, "state_dict": plain}, tmp_path / "checkpoint-3.pth.tar")
    torch.save({**run, "state_dict": plain, "state_dict_ema": ema}, tmp_path / "both.pth.tar")
    want, _ = params(tmp_path / "plain.pth", "timm")
    want_ema, _ = params(tmp_path / "ema.pth", "timm")
    got, notes = params(tmp_path / "checkpoint-3.pth.tar", "timm")
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    assert any("checkpoint-3.pth.tar: a training checkpoint: its 'state_dict' read" in note
               for note in notes)
    got, notes = params(tmp_path / "both.pth.tar", "timm")
    assert all(np.array_equal(a, b) for a, b in zip(got, want_ema, strict=True))
    assert any("its 'state_dict_ema' read (as timm's load_checkpoint reads it); it also holds "
               "['state_dict']" in note for note in notes)

    open_clip = import_open_clip()
    clip = open_clip.model.CLIP(**OPEN_CLIP_CFG).eval()
    perturb(clip, seed=6)
    state = {k: v.contiguous() for k, v in clip.state_dict().items()}
    torch.save(state, tmp_path / "clip.pt")
    torch.save({"epoch": 2, "name": "run", "optimizer": optimizer,
                "state_dict": {"module." + k: v for k, v in state.items()}},
               tmp_path / "epoch_2.pt")
    hints = Hints(heads=4, mlp="quick_gelu")
    want, _ = params(tmp_path / "clip.pt", "open_clip", hints)
    got, notes = params(tmp_path / "epoch_2.pt", "open_clip", hints)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    assert any("epoch_2.pt: a training checkpoint: its 'state_dict' read" in note
               for note in notes)
    assert "stripped the 'module.' prefix (a DistributedDataParallel state dict)" in notes
    # torch.compile's prefix, around DDP's, stripped as timm's clean_state_dict strips both
    torch.save({"epoch": 1, "state_dict": {"_orig_mod.module." + k: v for k, v in state.items()}},
               tmp_path / "compiled.pt")
    got, notes = params(tmp_path / "compiled.pt", "open_clip", hints)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    assert "stripped the '_orig_mod.' prefix (a torch.compile state dict)" in notes
    # the weights timm would read, empty or not a state dict: refused, not another entry read
    # (an empty EMA beside a full state_dict was read as the state_dict, said as timm's choice)
    for name, checkpoint, what in (("empty.pth.tar", {**run, "state_dict": {}},
                                    "'state_dict' .* is empty"),
                                   ("list.pth.tar", {**run, "state_dict": [1, 2]},
                                    "'state_dict' .* is a list"),
                                   ("ema.pth.tar", {**run, "state_dict": plain,
                                                    "state_dict_ema": {}},
                                    "'state_dict_ema' .* is empty")):
        torch.save(checkpoint, tmp_path / name)
        with pytest.raises(ConvertError, match=f"a training checkpoint whose {what}, not a "
                                               "state dict"):
            convert("timm", tmp_path / name, Hints(heads=4))
    torch.save({"teacher": plain}, tmp_path / "teacher.pth")  # DINOv2's training layout
    with pytest.raises(ConvertError, match=r"its weights are under 'teacher' \(\d+ tensors, a "
                                           "training checkpoint's layout"):
        convert("timm", tmp_path / "teacher.pth", Hints(heads=4))


def test_files_that_are_no_checkpoint_are_named_so_and_no_unsafe_load_is_advised(tmp_path):
    """Zeros or text under a weight file's name: torch took zeros for its legacy tar format and
    advised `weights_only=False` ("arbitrary code execution"), text was said to hold pickled
    objects, and numpy took zeros for a pickle and advised `allow_pickle`. Each is named for
    what it is not now; a legacy tar checkpoint is named as one; checkpoints still read."""
    import tarfile

    model = timm.create_model("vit_base_patch16_224", pretrained=False, **TIMM_SHAPE).eval()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    (tmp_path / "zeros.pth").write_bytes(bytes(4096))
    (tmp_path / "text.bin").write_bytes(b"not a checkpoint at all\n")
    (tmp_path / "zeros.npz").write_bytes(bytes(4096))
    with tarfile.open(tmp_path / "old.pth", "w") as tar:  # torch.save's format before 0.4
        tar.add(tmp_path / "text.bin", arcname="storages")
    cases = {
        "zeros.pth": "not a PyTorch checkpoint (neither a zip archive nor a pickle)",
        "text.bin": "not a PyTorch checkpoint (neither a zip archive nor a pickle)",
        "zeros.npz": "not an .npz archive (no zip directory)",
        "old.pth": "saved in PyTorch's legacy tar format, which cannot be read without running "
                   "its pickles",
    }
    for name, words in cases.items():
        source = "big_vision" if name.endswith(".npz") else "timm"
        with pytest.raises(ConvertError) as caught:
            convert(source, tmp_path / name, Hints(heads=4))
        message = str(caught.value)
        assert message.startswith(f"{tmp_path / name}: {words}"), message
        assert not re.search(r"weights_only|allow_pickle|pickled", message), message
    # both of torch.save's formats since 0.4 still read: its zip, and its plain pickle
    for zipped in (True, False):
        torch.save(state, tmp_path / "ok.pth", _use_new_zipfile_serialization=zipped)
        assert convert("timm", tmp_path / "ok.pth", Hints(heads=4)).config.heads == 4


def test_a_zip_of_weights_is_counted_unpacked(tmp_path):
    """The memory check before a conversion (model/convert.py) counted an .npz or a PyTorch
    zip by its size on disk: a compressed file of zeros 1/1000 of what it unpacks to passed it
    whatever it held. It counts what the zip's directory says the reader will hold."""
    np.savez_compressed(tmp_path / "zeros.npz", w=np.zeros(16 << 20, np.float32))  # 64 MiB
    assert (tmp_path / "zeros.npz").stat().st_size < 1 << 20
    assert unpacked_size(tmp_path / "zeros.npz") >= 64 << 20
    torch.save({"w": torch.zeros(1 << 20)}, tmp_path / "w.pth")  # stored, not deflated: as is
    assert 4 << 20 <= unpacked_size(tmp_path / "w.pth") <= (tmp_path / "w.pth").stat().st_size
    (tmp_path / "junk.bin").write_bytes(b"PK" + bytes(100))  # no directory: its size
    assert unpacked_size(tmp_path / "junk.bin") == 102
