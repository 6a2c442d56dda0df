"""Probe reports: one JSON file per run (numpy values turned into plain JSON)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from vit22b.clients.storage import atomic_write


def to_jsonable(value):
    """Dicts, lists, numpy scalars and arrays -> JSON types; NaN and infinities -> None."""
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return to_jsonable(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_report(report: dict, out_dir: str | Path, name: str) -> Path:
    """Write ``<out_dir>/<name>.json`` whole or not at all (temporary file, then rename)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    text = (json.dumps(to_jsonable(report), indent=2) + "\n").encode()
    atomic_write(str(path), lambda f: f.write(text))
    return path


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def summarize(report: dict) -> str:
    """A few lines with each probe's headline figures beside its trivial baseline."""
    kind = report.get("probe")
    base = report.get("baselines", {})
    if kind == "linear":
        return (
            f"linear: top-1 {_fmt(report['top1'])}, top-5 {_fmt(report['top5'])} "
            f"(C={report['best_C']:g}); chance {_fmt(base['chance_top1'])}, "
            f"majority {_fmt(base['majority_top1'])}"
        )
    if kind == "fewshot":
        shots = ", ".join(
            f"{k}-shot {_fmt(v['top1_mean'])}±{v['top1_std']:.3f}"
            for k, v in report["shots"].items()
        )
        return f"fewshot: {shots}; chance {_fmt(base['chance_top1'])}"
    if kind == "knn":
        ks = ", ".join(f"k={k} {_fmt(v['top1'])}" for k, v in report["by_k"].items())
        return f"knn top-1: {ks}; chance {_fmt(base['chance_top1'])}"
    if kind == "calibration":
        b, a = report["before"], report["after"]
        limit, temperature = report.get("temperature_limit"), report["temperature"]
        return (
            f"calibration (T={'none' if temperature is None else f'{temperature:.4g}'}): "
            f"ECE {_fmt(b['ece'])} -> "
            f"{_fmt(a['ece'])}, NLL {_fmt(b['nll'])} -> {_fmt(a['nll'])}, "
            f"accuracy {_fmt(b['accuracy'])}" + (f"; {limit}" if limit else "")
        )
    if kind == "depth":
        lines = [
            f"depth {k}: RMSE {_fmt(report[k]['rmse'])}, AbsRel {_fmt(report[k]['abs_rel'])},"
            f" delta1 {_fmt(report[k]['delta1'])}"
            for k in ("linear", "dpt")
            if k in report
        ]
        mean = base["mean_depth"]
        lines.append(
            f"depth mean-depth baseline: RMSE {_fmt(mean['rmse'])}, "
            f"AbsRel {_fmt(mean['abs_rel'])}, delta1 {_fmt(mean['delta1'])}"
        )
        return "\n".join(lines)
    if kind == "segmentation":
        lin = report["linear"]
        return (
            f"segmentation: mIoU {_fmt(lin['miou'])}, pixel accuracy "
            f"{_fmt(lin['pixel_accuracy'])}; majority class: mIoU "
            f"{_fmt(base['majority_miou'])}, pixel accuracy "
            f"{_fmt(base['majority_pixel_accuracy'])}"
        )
    if kind == "shape-bias":
        return (
            f"shape bias {_fmt(report['shape_bias'])} ({report['shape_decisions']} shape, "
            f"{report['texture_decisions']} texture, {report['other_decisions']} other "
            f"decisions; {report['same_category_excluded']} same-category images left out)"
        )
    if kind == "video":
        return (
            f"video ({report['frames_per_video']} frames): attention head top-1 "
            f"{_fmt(report['attention']['top1'])}, linear on the temporal mean "
            f"{_fmt(report['temporal_mean']['top1'])}, middle frame alone "
            f"{_fmt(report['middle_frame']['top1'])}; chance {_fmt(base['chance_top1'])}"
        )
    if kind == "diagnostics":
        layers = ", ".join(f"L{r['layer']} {r['entropy_mean']:.3f}" for r in report["per_layer"])
        collapsed = report.get("collapsed_heads")
        judged = ("; collapse not judged (the number of tokens is unknown)" if collapsed is None
                  else f"; collapsed heads: {collapsed}" if collapsed else "")
        return f"attention entropy by layer: {layers}{judged}"
    return f"{kind}: see the JSON report"
