"""PNG figures of the probes (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from vit22b.clients.storage import atomic_write


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    """``fig`` as ``path`` (its suffix the format), whole or not at all."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        atomic_write(str(path), lambda f: fig.savefig(f, dpi=100,
                                                      format=path.suffix.lstrip(".") or "png"))
    finally:
        _pyplot().close(fig)
    return path


def reliability_diagram(report: dict, path: str | Path) -> Path:
    """Accuracy per confidence bin before and after temperature scaling, against the diagonal."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2), sharey=True)
    for ax, key, title in (
        (axes[0], "before", "before"),
        (axes[1], "after", "after temperature scaling " + (
            "(none: no finite T)" if report["temperature"] is None
            else f"(T={report['temperature']:.3g})")),
    ):
        rows = report[f"reliability_{key}"]
        width = rows[0]["high"] - rows[0]["low"]
        filled = [r for r in rows if r["count"]]
        ax.bar(
            [r["low"] for r in filled],
            [r["accuracy"] for r in filled],
            width=width,
            align="edge",
            edgecolor="black",
            color="tab:blue",
            label="accuracy",
        )
        ax.hlines(
            [r["confidence"] for r in filled],
            [r["low"] for r in filled],
            [r["high"] for r in filled],
            colors="tab:red",
            lw=2.5,
            label="mean confidence",
        )
        ax.plot([0, 1], [0, 1], "k--", lw=1)
        metrics = report[key]
        ax.set_title(f"{title}\nECE {metrics['ece']:.3f}  NLL {metrics['nll']:.3f}", fontsize=9)
        ax.set_xlabel("confidence")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("accuracy")
    axes[0].legend(loc="upper left", fontsize=8)
    return _save(fig, path)


def depth_figure(
    images: np.ndarray, truth: np.ndarray, predictions: dict[str, np.ndarray], path, rows: int = 4
) -> Path:
    """Per row: the image, the ground-truth depth, then each decoder's prediction."""
    plt = _pyplot()
    rows = min(rows, len(truth))
    cols = 2 + len(predictions)
    fig, axes = plt.subplots(rows, cols, figsize=(2.2 * cols, 2.2 * rows), squeeze=False)
    vmin, vmax = float(truth[:rows].min()), float(truth[:rows].max())
    for r in range(rows):
        panels = [("image", images[r], {})] if images is not None else [("image", None, {})]
        panels.append(("ground truth", truth[r], {"vmin": vmin, "vmax": vmax}))
        panels += [(k, v[r], {"vmin": vmin, "vmax": vmax}) for k, v in predictions.items()]
        for c, (title, data, kw) in enumerate(panels):
            ax = axes[r][c]
            ax.axis("off")
            if data is not None:
                ax.imshow(data, cmap=None if data.ndim == 3 else "magma_r", **kw)
            if r == 0:
                ax.set_title(title, fontsize=9)
    return _save(fig, path)


def segmentation_figure(
    images: np.ndarray, truth: np.ndarray, pred: np.ndarray, path,
    ignore_index: int | None = None, rows: int = 4,
) -> Path:
    """Image, ground truth (ignored pixels black) and prediction, a row per test image."""
    plt = _pyplot()
    classes = plt.get_cmap("tab20").with_extremes(bad="black")
    if ignore_index is not None:
        truth = np.ma.masked_equal(truth, ignore_index)
    rows = min(rows, len(truth))
    fig, axes = plt.subplots(rows, 3, figsize=(6.6, 2.2 * rows), squeeze=False)
    for r in range(rows):
        for c, (title, data) in enumerate(
            (
                ("image", None if images is None else images[r]),
                ("ground truth", truth[r]),
                ("linear decoder", pred[r]),
            )
        ):
            ax = axes[r][c]
            ax.axis("off")
            if data is not None:
                kw = {} if data.ndim == 3 else {"cmap": classes, "vmin": 0, "vmax": 19}
                ax.imshow(data if data.ndim == 3 else data % 20, interpolation="nearest", **kw)
            if r == 0:
                ax.set_title(title, fontsize=9)
    return _save(fig, path)


def entropy_vs_scale(report: dict, path: str | Path) -> Path:
    """``vit22b explore``: attention entropy against the query/key weight scale, per variant."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rows in report["variants"].items():
        style = "-" if "qk_norm=on" in name else "--"
        ax.plot(
            [r["scale"] for r in rows], [r["entropy"] for r in rows], style, marker="o", label=name
        )
    ax.axhline(report["uniform_entropy"], color="grey", lw=0.8, ls=":", label="uniform")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("query/key weight scale")
    ax.set_ylabel("attention entropy (nats)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def attention_heatmaps(report: dict, path: str | Path) -> Path:
    """Mean attention entropy and largest max-logit, layers x heads."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key, title in (
        (axes[0], "entropy_mean", "mean attention entropy (nats)"),
        (axes[1], "max_logit_max", "largest attention logit"),
    ):
        data = np.asarray(report[key])
        image = ax.imshow(data, aspect="auto", cmap="viridis")
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(title, fontsize=9)
        fig.colorbar(image, ax=ax)
    return _save(fig, path)


def shape_bias_figure(report: dict, path: str | Path) -> Path:
    """Shape bias per shape category (categories without cue decisions are left blank)."""
    plt = _pyplot()
    names = list(report["per_category"])
    values = [report["per_category"][n]["shape_bias"] for n in names]
    fig, ax = plt.subplots(figsize=(max(4, 0.45 * len(names) + 1.5), 3.5))
    ax.bar(range(len(names)), [np.nan if v is None else v for v in values], color="tab:green")
    overall = report["shape_bias"]
    if overall is not None:
        ax.axhline(overall, color="black", ls="--", lw=1, label=f"overall {overall:.2f}")
        ax.legend(fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("shape / (shape + texture)")
    return _save(fig, path)
