"""``vit22b probe KIND`` and ``vit22b explore``.

Images (with their labels, depth maps or masks) come from one of ``--shapes-world N``,
``--digits`` or ``--data DIR`` (videos, for ``video``: ``--moving-world N`` or ``--data DIR``);
their features from a server (``--server ADDR``) or, without one, the backbone run in-process
(``--model``, random weights from ``--seed``). ``--features PATH`` reads features computed
before (a .npz written with ``--save-features``, or a ``vit22b embed`` output folder). Reports
go to ``--out`` as ``<kind>.json`` plus a PNG where a picture helps.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
from vit22b.clients.settings import parse_tls
from vit22b.model.compile_cache import (
    COMPILE_CACHE_DEFAULT_HELP,
    COMPILE_CACHE_HELP,
    default_compile_cache,
)
from vit22b.model.config import parse_seed
from vit22b.model.schema import real_number, whole_number

from .data import (
    IGNORE_INDEX,
    DataError,
    LabelledImages,
    cue_conflict_labels,
    dense_targets,
    image_files,
    labels_from_folders,
    load_digits_images,
    load_image_folder,
    read_images,
    shapes_world,
)
from .features import features_from_embed_folder
from .runner import KINDS, ProbeData, load_probe_data, probe_data_from_shapes_world, run_probe

DENSE = ("depth", "segmentation")
MAX_STEPS = 100_000  # decoder training steps (300 by default)
MAX_BINS = 1_000  # calibration bins (15 by default; a reliability row each in the report)
# the server's codes for what the caller sent (exit 2, as a refusal of ours); others exit 1
REFUSED_INPUT = frozenset({"INVALID_ARGUMENT", "OUT_OF_RANGE", "FAILED_PRECONDITION",
                           "UNAUTHENTICATED", "PERMISSION_DENIED"})


MAX_LIST = 64  # values in one list flag (each is a probe run of its own)


def _number_list(cast, what: str):
    """argparse type: comma-separated numbers -> tuple, of 1 to ``MAX_LIST``."""

    def parse(text: str) -> tuple:
        try:
            values = tuple(cast(v) for v in text.split(",") if v.strip())
        except ValueError:
            values = ()
        if not 0 < len(values) <= MAX_LIST:
            raise argparse.ArgumentTypeError(
                f"expected 1 to {MAX_LIST} comma-separated {what}, got {text!r}")
        return values

    return parse


_ints, _floats = _number_list(whole_number, "integers"), _number_list(real_number, "numbers")


def _label_or_none(text: str) -> int | None:
    if text.lower() == "none":
        return None
    try:
        label = whole_number(text)
    except ValueError:
        label = -1
    if label < 0:
        raise argparse.ArgumentTypeError(f"expected a mask label (0 or more) or none, got {text!r}")
    return label


def _seed_from_zero(why: str):
    """argparse type: a seed as ``parse_seed`` reads it, 0 or more (``why``: who needs that)."""

    def parse(text: str) -> int:
        seed = parse_seed(text)
        if seed < 0:
            raise argparse.ArgumentTypeError(f"{why}: 0 or more, got {seed}")
        return seed

    return parse


# the probe's seed also seeds numpy's data split; the shapes world's is numpy's alone
_split_seed = _seed_from_zero("the seed also seeds the data split")
_world_seed = _seed_from_zero("the shapes world's seed is numpy's")


def _positive(parse, most: float = math.inf):
    """``parse``, then every value > 0 (a 0-NN vote or a 0-shot probe means nothing) and at
    most ``most`` (a bound on the time or the report one value can ask for)."""
    bound = "" if math.isinf(most) else f" of at most {most:,}"

    def checked(text: str):
        try:
            values = parse(text)
        except ValueError as err:  # not a number: its own words (argparse: "invalid checked")
            raise argparse.ArgumentTypeError(f"expected positive values{bound}: {err}") from None
        if not all(0 < v <= most and math.isfinite(v)  # an infinite temperature votes uniformly
                   for v in (values if isinstance(values, tuple) else (values,))):
            raise argparse.ArgumentTypeError(f"expected positive values{bound}, got {text!r}")
        return values

    return checked


def _probe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", choices=KINDS, help="which probe to run")
    src = parser.add_argument_group("images and targets (one of)")
    one = src.add_mutually_exclusive_group(required=True)
    one.add_argument(
        "--shapes-world",
        type=whole_number,
        metavar="N",
        help="generate N shapes-world images (shape-bias: N cue-agreeing images to "
        "train on, plus --conflict cue-conflict images to test)",
    )
    one.add_argument("--digits", action="store_true", help="scikit-learn's bundled digits")
    one.add_argument(
        "--moving-world",
        type=whole_number,
        metavar="N",
        help="video: N moving-shapes videos (approaching or receding), written as MP4 files "
        "under --out",
    )
    one.add_argument(
        "--data",
        type=Path,
        metavar="DIR",
        help="class subfolders (video: of video files); for shape-bias a cue-conflict folder "
        "(<shape>/<shape>N-<texture>M.png); for depth/segmentation a folder "
        "of images with --depth and/or --masks",
    )
    one.add_argument(
        "--features",
        type=Path,
        metavar="PATH",
        help="features computed before: a .npz from --save-features, or a "
        "`vit22b embed` output folder (video: of `vit22b embed --frames K`)",
    )
    src.add_argument(
        "--depth",
        type=Path,
        metavar="DIR",
        help="depth maps (.npy or 16-bit PNG) matched to --data images by file stem",
    )
    src.add_argument(
        "--masks",
        type=Path,
        metavar="DIR",
        help="indexed-PNG segmentation masks matched to --data images by file stem",
    )
    src.add_argument(
        "--conflict",
        type=whole_number,
        metavar="N",
        help="shape-bias on the shapes world: cue-conflict images (default N/3)",
    )
    src.add_argument("--world-seed", type=_world_seed, default=0, help="seed of the shapes world")
    src.add_argument(
        "--frames", type=_positive(whole_number), metavar="K",
        help="video: frames sampled per video, at the centres of K equal segments (default 9)",
    )
    src.add_argument("--world-size", type=_positive(whole_number),
                     help="shapes-world image side in pixels (default: --resolution, else 64)")

    feat = parser.add_argument_group("features of the images")
    feat.add_argument("--server", metavar="ADDR", help="a running `vit22b serve` (host:port)")
    feat.add_argument("--token", help="bearer token for the server")
    feat.add_argument("--tls", nargs="?", const=True, default=False, type=parse_tls,
                      metavar="PEM", help="TLS to the server (alone: the system's roots; or a "
                      "PEM file of trusted roots)")
    feat.add_argument("--resolution", type=whole_number, default=0,
                      help="square input size of the features (one the server allows; default: "
                      "the model's own): depth and segmentation at resolution")
    feat.add_argument(
        "--model",
        help="without --server: the preset run in-process with random "
        "weights (default: the served default)",
    )
    feat.add_argument(
        "--seed", type=_split_seed, default=0, help="weights seed (in-process) and split seed"
    )
    feat.add_argument(
        "--compile-cache", metavar="DIR|off",
        help="for what this command compiles (the backbone without --server or --features; the "
        f"depth, segmentation and video decoders): {COMPILE_CACHE_HELP} "
        f"({COMPILE_CACHE_DEFAULT_HELP})",
    )
    feat.add_argument(
        "--layers",
        type=_ints,
        default=None,
        metavar="I,J,...",
        help="patch-token layers for depth/segmentation, negative from the end "
        "(default: 4 evenly spaced, ending at the last block)",
    )
    feat.add_argument(
        "--feature",
        choices=("pooled", "class_token", "patch_mean"),
        default="pooled",
        help="what classification probes read",
    )
    feat.add_argument(
        "--head",
        type=Path,
        metavar="FILE",
        help="imported classifier head (.npz: kernel [d, C], bias [C], "
        "class_names) for calibration and shape-bias",
    )
    feat.add_argument(
        "--save-features",
        type=Path,
        metavar="PATH",
        help="also save the features and targets to this .npz",
    )

    opt = parser.add_argument_group("probe options")
    opt.add_argument("--steps", type=_positive(whole_number, MAX_STEPS),
                     help="decoder training steps (depth, segmentation, video)")
    opt.add_argument("--decoders", default="linear,dpt", help="depth decoders (linear, dpt)")
    opt.add_argument("--train-stride", type=_positive(whole_number, 8),
                     help="depth, segmentation: train the decoders at 1/N of the maps' "
                     "resolution (2; 1: full resolution, for detail finer than 2 pixels)")
    opt.add_argument("--shots", type=_positive(_ints),
                     help="few-shot: shots per class (1,5,10,25)")
    opt.add_argument("--ks", type=_positive(_ints), help="kNN: neighbour counts (10,20,100,200)")
    opt.add_argument("--temperature", type=_positive(real_number),
                     help="kNN: vote temperature (0.07)")
    opt.add_argument("--bins", type=_positive(whole_number, MAX_BINS),
                     help=f"calibration: bins (15; at most {MAX_BINS:,})")
    opt.add_argument("--ignore-index", type=_label_or_none, default=IGNORE_INDEX,
                     metavar="N|none",
                     help="segmentation: the mask label of pixels that are no class, left out "
                     f"of training and scoring (default {IGNORE_INDEX}; none: every label is "
                     "a class)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("probe-reports"),
        help="folder for <kind>.json and PNGs (default: probe-reports)",
    )


def _embed(args, images, kind: str):
    """Features of ``images`` from the server, or from the model in-process."""
    layers = args.layers or ("auto" if kind in DENSE else ())
    stats = kind == "diagnostics"
    if args.server:
        from .features import features_from_server

        return features_from_server(
            args.server, images, patch_layers=layers, attention_stats=stats,
            resolution=args.resolution, token=args.token, tls=args.tls,
        )
    from .features import features_from_model

    files = not isinstance(images, np.ndarray) and all(
        isinstance(image, (str, Path)) for image in images)
    return features_from_model(  # files as their bytes: decoded as a server decodes them
        (_file_bytes(image) for image in images) if files else images,  # read as needed
        ids=[str(image) for image in images] if files else None,
        model=args.model,
        seed=args.seed,
        patch_layers=layers,
        attention_stats=stats,
        resolution=args.resolution,
    )


def _file_bytes(path) -> bytes:
    """An image file's bytes, as the embed job reads them (a regular file, at most 1 GiB)."""
    from vit22b.clients.files import MAX_IMAGE_BYTES, os_reason, read_local

    try:
        return read_local(str(path), MAX_IMAGE_BYTES)
    except OSError as err:
        raise DataError(f"{path}: {os_reason(err)}") from None


def _image_data(args, kind: str, data: LabelledImages) -> ProbeData:
    """In-memory images (digits) with their labels, embedded."""
    return ProbeData(
        features=_embed(args, data.images, kind),
        labels=data.labels,
        class_names=data.class_names,
        images=np.stack(data.images),
    )


def _targets_of_paths(args, kind: str, paths: list) -> dict:
    """ProbeData targets of image files, from their names, folders and label folders."""
    if kind in DENSE:
        depth, mask = dense_targets(paths, args.depth, args.masks)
        return {"depth": depth, "mask": mask}
    labels, names = labels_from_folders(paths)
    if len(names) < 2 and kind != "diagnostics":
        raise DataError(f"an image's class is the name of its folder, and all {len(paths)} "
                        f"images are in {Path(paths[0]).parent}: the {kind} probe needs a "
                        "subfolder per class")
    if kind == "shape-bias":
        shapes, textures = cue_conflict_labels(paths, names)
        return {"labels": shapes, "texture": textures, "class_names": names}
    return {"labels": labels, "class_names": names}


def _probe_data(args, kind: str) -> tuple[ProbeData, dict]:
    """The data to probe and the extra keyword arguments of ``run_probe``."""
    extra: dict = {}
    if args.features and args.layers:  # they choose what is computed; a file holds its own
        raise DataError(f"--layers chooses the layers computed; {args.features} holds its own "
                        "(drop --layers, or embed those layers into it)")
    if args.features and not args.features.is_dir():
        return load_probe_data(args.features), extra
    if args.features:  # a `vit22b embed` output folder: targets from the embedded files
        features, paths = features_from_embed_folder(args.features)
        return ProbeData(features=features, **_targets_of_paths(args, kind, paths)), extra
    if args.shapes_world:
        size = args.world_size or args.resolution or 64
        if kind == "shape-bias":
            train = shapes_world(args.shapes_world, seed=args.world_seed, texture="matched",
                                 size=size)
            n = args.conflict or max(args.shapes_world // 3, 1)
            test = shapes_world(n, seed=args.world_seed + 1, texture="conflict", size=size)
            extra["train"] = probe_data_from_shapes_world(train, _embed(args, train.images, kind))
            return probe_data_from_shapes_world(test, _embed(args, test.images, kind)), extra
        world = shapes_world(args.shapes_world, seed=args.world_seed, size=size)
        return probe_data_from_shapes_world(world, _embed(args, world.images, kind)), extra
    if args.digits:
        return _image_data(args, kind, load_digits_images()), extra
    if kind in DENSE:  # the figures show the images beside their targets
        paths = image_files(args.data)
        images = read_images(paths)  # every file decodes, or the first that does not is named
    else:  # decoded once, by the embedding, which names a file it cannot use
        paths, images = load_image_folder(args.data).images, None
    data = ProbeData(
        features=_embed(args, paths, kind),
        **_targets_of_paths(args, kind, paths),
    )
    if images is not None and len({a.shape for a in images}) == 1:
        data.images = np.stack(images)
    return data, extra


# what the video probe reads: pooled features of each frame at the model's own resolution
# (--shapes-world, --digits and --save-features: refused by _video_data, which says why)
VIDEO_READS = frozenset({"kind", "moving_world", "data", "features", "frames", "world_seed",
                         "server", "token", "tls", "model", "seed", "compile_cache", "steps",
                         "out", "shapes_world", "digits", "save_features"})


# what computes features: not read where --features holds features computed before
COMPUTE_FLAGS = frozenset({"server", "token", "tls", "model", "resolution"})


def _given(args, dests) -> list[str]:
    """The flags of ``dests`` given (not at their defaults)."""
    defaults = argparse.ArgumentParser()
    _probe_arguments(defaults)
    return ["--" + dest.replace("_", "-") for dest, value in vars(args).items()
            if dest in dests and value != defaults.get_default(dest)]


def _unread(args, reads: frozenset) -> list[str]:
    """The flags given (not at their defaults) that a probe reading ``reads`` would ignore."""
    return _given(args, set(vars(args)) - reads)


def _video_data(args):
    """Per-frame features of labelled videos (probes/video.py)."""
    from .video import VideoFeatures
    from .video_data import (
        load_video_folder,
        moving_world,
        video_features,
        video_features_from_embed_folder,
        write_moving_world,
    )

    if args.save_features:
        raise DataError("--save-features is for image probes; a video embed output folder "
                        "(`vit22b embed --frames K`) keeps video features")
    if args.features and args.frames:  # the folder's own K was chosen when it was embedded
        raise DataError(f"--frames chooses the frames sampled; {args.features} holds its own "
                        "(drop --frames, or embed the videos again with --frames K)")
    if args.features:
        frames, stamps, paths, meta = video_features_from_embed_folder(args.features)
        return VideoFeatures(frames, *labels_from_folders(paths), stamps, meta)
    if args.moving_world:
        world = moving_world(args.moving_world, seed=args.world_seed)
        paths = write_moving_world(world, args.out / "moving-world")
        labels, names = world.labels, world.class_names
    elif args.data:
        videos = load_video_folder(args.data)
        paths, labels, names = videos.paths, videos.labels, videos.class_names
    else:
        raise DataError("the video probe reads videos: --moving-world N, --data DIR (class "
                        "subfolders of videos) or --features DIR (a `vit22b embed --frames K` "
                        "output)")
    frames, stamps, meta = video_features(paths, args.frames or 9, server=args.server,
                                          token=args.token, tls=args.tls, model=args.model,
                                          seed=args.seed)
    return VideoFeatures(frames, labels, names, stamps, meta)


def _options(args, kind: str) -> dict:
    """Probe options given on the command line (others keep the probe's defaults)."""
    chosen = {}
    if kind == "video" and args.steps:
        chosen["steps"] = args.steps
    if kind in ("linear", "fewshot", "knn", "calibration", "shape-bias"):
        chosen["feature"] = args.feature
    if kind in DENSE and args.steps:
        chosen["steps"] = args.steps
    if kind in DENSE and args.train_stride:
        chosen["train_stride"] = args.train_stride
    if kind == "depth":
        chosen["decoders"] = tuple(d.strip() for d in args.decoders.split(",") if d.strip())
    if kind == "fewshot" and args.shots is not None:
        chosen["shots"] = args.shots
    if kind == "knn":
        if args.ks is not None:
            chosen["ks"] = args.ks
        if args.temperature is not None:
            chosen["temperature"] = args.temperature
    if kind == "segmentation":
        chosen["ignore_index"] = args.ignore_index
    if kind == "calibration" and args.bins is not None:
        chosen["bins"] = args.bins
    if kind in ("calibration", "shape-bias") and args.head:
        from .heads import load_head

        chosen["head"] = load_head(args.head)
    return chosen


def _writable_folder(folder: Path, what: str) -> None:
    """``folder`` made if missing, or DataError naming ``what`` when it cannot hold files
    (tried with a file of its own: permissions alone do not tell, for root or on /proc)."""
    if folder.exists() and not folder.is_dir():
        raise DataError(f"{what}: {folder} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise DataError(f"{what}: {folder} cannot hold files ({err.strerror})") from None


def _check_outputs(args) -> None:
    """The report folder and the features file can be written: checked before the model
    runs, not after it (every minute of embedding and training was lost to a typo)."""
    _writable_folder(args.out, f"--out {args.out}")
    if args.save_features:
        if args.save_features.is_dir():
            raise DataError(f"--save-features {args.save_features}: a folder, not a file name")
        _writable_folder(args.save_features.parent, f"--save-features {args.save_features}")


def _use_compile_cache(directory: str | None) -> None:
    """JAX's persistent cache for this process's compiles: the backbone's forwards and the
    decoders' training steps, compiled afresh at every run without it."""
    from vit22b.model.compile_cache import use_compile_cache

    use_compile_cache(directory or default_compile_cache())


def _run_probe_command(args) -> int:
    from vit22b.clients.client import FeatureError

    from .report import summarize
    from .runner import save_probe_data

    kind = args.kind
    try:
        if kind in DENSE and args.data and not (args.depth or args.masks):
            raise DataError(f"{kind} on --data needs --depth DIR or --masks DIR")
        if kind == "shape-bias" and not args.shapes_world and not args.head:
            raise DataError(
                "shape-bias on given images needs their decisions: --head FILE "
                "(a 16-way or 1000-way ImageNet head on pooled features)"
            )
        if args.shapes_world is not None and args.shapes_world < 8:
            raise DataError("--shapes-world needs at least 8 images")
        if kind != "video" and args.moving_world is not None:
            raise DataError("--moving-world is for the video probe (vit22b probe video)")
        options = _options(args, kind)  # reads --head first: fail before embedding anything
        _check_outputs(args)  # and where the results go
        if kind in (*DENSE, "video") or not (args.server or args.features):
            _use_compile_cache(args.compile_cache)
        if args.features and (unread := _given(args, COMPUTE_FLAGS)):
            raise DataError(f"{', '.join(unread)}: not read with --features, whose features "
                            "were computed before (drop them, or compute features from --data)")
        if kind == "video":
            if unread := _unread(args, VIDEO_READS):
                raise DataError(f"{', '.join(unread)}: not read by the video probe (pooled "
                                "features of each frame, at the model's own resolution)")
            if args.moving_world is not None and args.moving_world < 8:
                raise DataError("--moving-world needs at least 8 videos")
            data, extra = _video_data(args), {}
        else:
            data, extra = _probe_data(args, kind)
        if args.save_features:
            save_probe_data(args.save_features, data)
        report = run_probe(kind, data, out_dir=args.out, seed=args.seed, **extra, **options)
    except (DataError, ValueError) as err:
        print(f"vit22b probe {kind}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # the inputs' are DataErrors: this is writing the results
        print(f"vit22b probe {kind}: error: {_disk(err, args.out)}", file=sys.stderr)
        return 1
    except FeatureError as err:  # the server refused the images, or was not there
        print(f"vit22b probe {kind}: error: the server at {args.server}: {err}", file=sys.stderr)
        return 2 if err.code.name in REFUSED_INPUT else 1
    print(summarize(report))
    print(
        f"report: {report['report']}"
        + (f"  figure: {report['figure']}" if "figure" in report else "")
    )
    return 0


EXPLORE_MAX_TOKENS, EXPLORE_MAX_WIDTH, EXPLORE_MAX_SCALES = 512, 512, 32
EXPLORE_MAX_SCALE = 1e4  # past it float32's squares overflow in the QK-norm (1e20: inf)


def _explore_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scales",
        type=_floats,
        help="query/key weight scales (comma-separated; default: 0.25 to 32, by factors of 2)",
    )
    parser.add_argument("--tokens", type=whole_number, default=8, help="sequence length")
    parser.add_argument("--width", type=whole_number, default=32, help="model width (one head)")
    parser.add_argument("--seed", type=parse_seed, default=0)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("probe-reports"),
        help="folder for explore.json and entropy_vs_scale.png",
    )


def _run_explore_command(args) -> int:
    # bounded: its attention maps are scales x batch x tokens^2 floats at once, per variant
    if not (2 <= args.tokens <= EXPLORE_MAX_TOKENS and 2 <= args.width <= EXPLORE_MAX_WIDTH
            and (args.scales is None or 0 < len(args.scales) <= EXPLORE_MAX_SCALES
                 and all(0 < s <= EXPLORE_MAX_SCALE for s in args.scales))):
        print(
            f"vit22b explore: error: needs --tokens in 2..{EXPLORE_MAX_TOKENS}, --width in "
            f"2..{EXPLORE_MAX_WIDTH} and 1..{EXPLORE_MAX_SCALES} --scales in (0, "
            f"{EXPLORE_MAX_SCALE:g}]",
            file=sys.stderr,
        )
        return 2
    from .explore import DEFAULT_SCALES, explore, format_table  # jax: once the flags are read
    from .plots import entropy_vs_scale
    from .report import write_report

    scales = DEFAULT_SCALES if args.scales is None else args.scales
    report = explore(scales, tokens=args.tokens, width=args.width, seed=args.seed)
    try:
        figure = entropy_vs_scale(report, args.out / "entropy_vs_scale.png")
        report["figure"] = str(figure)
        path = write_report(report, args.out, "explore")
    except OSError as err:
        print(f"vit22b explore: error: {_disk(err, args.out)}", file=sys.stderr)
        return 1
    print(format_table(report))
    print(f"report: {path}  figure: {figure}")
    return 0


def _disk(err: OSError, out: Path) -> str:
    """A failed write (a full disk, a folder that cannot be made) in one line, naming the file."""
    return f"{err.filename or out}: {err.strerror or err}"


def add_arguments(command: str, parser: argparse.ArgumentParser):
    """The dispatcher's contract: register the command's options, return its handler."""
    if command == "probe":
        _probe_arguments(parser)
        return _run_probe_command
    if command == "explore":
        _explore_arguments(parser)
        return _run_explore_command
    raise ValueError(f"vit22b.probes.cli does not provide the command {command!r}")
