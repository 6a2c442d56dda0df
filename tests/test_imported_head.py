"""A converted checkpoint's classifier, applied by the probes to served pooled features.

timm model with a 1000-way head -> `vit22b convert` (checkpoint + head.npz) -> `vit22b serve`
on that checkpoint -> `vit22b probe shape-bias --server ... --head head.npz` on the real
cue-conflict sample. The head on served features must reproduce timm's own logits.
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from peers import import_timm, perturb  # noqa: E402
from vit22b.clients import FeatureClient  # noqa: E402
from vit22b.clients.cli import main  # noqa: E402
from vit22b.clients.demo import SAMPLE  # noqa: E402
from vit22b.model.checkpoint import read_metadata  # noqa: E402
from vit22b.model.pixels import Preprocessor  # noqa: E402
from vit22b.probes.heads import load_head  # noqa: E402
from vit22b.server.app import BackgroundServer, ServeConfig  # noqa: E402


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    timm = import_timm()
    model = timm.create_model(
        "vit_base_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=64,
        depth=2, num_heads=4, num_classes=1000,
    ).eval()
    perturb(model, seed=3)
    folder = tmp_path_factory.mktemp("imported")
    weights = folder / "model.safetensors"
    safetensors_torch.save_file(model.state_dict(), str(weights))
    ckpt = folder / "ckpt"
    code = main(["convert", "--from", "timm", "--input", str(weights), "--heads", "4",
                 "--out", str(ckpt)])  # fmt: skip
    assert code == 0
    return model, ckpt


def test_convert_writes_the_classifier_as_a_probe_head(converted):
    model, ckpt = converted
    head = load_head(ckpt / "head.npz")
    np.testing.assert_allclose(head.kernel, model.head.weight.detach().numpy().T, rtol=1e-6)
    np.testing.assert_allclose(head.bias, model.head.bias.detach().numpy(), rtol=1e-6)
    assert read_metadata(str(ckpt)).config.num_classes == 1000


def test_head_on_served_features_reproduces_the_peer_and_measures_shape_bias(converted, tmp_path):
    model, ckpt = converted
    cfg = read_metadata(str(ckpt)).config.replace(compute_dtype="float32")
    config = ServeConfig(checkpoint=str(ckpt), mesh="data=2,model=4", port=0, metrics_port=None,
                         max_batch_images=8)  # fmt: skip
    server = BackgroundServer(config).start()
    try:
        address = server.address
        rng = np.random.default_rng(0)
        pixels = [rng.integers(0, 256, (40, 48, 3), dtype=np.uint8) for _ in range(4)]
        with FeatureClient(address) as client:
            pooled = client.embed(pixels, outputs=["pooled"]).pooled.astype(np.float32)
        head = load_head(ckpt / "head.npz")
        ours = pooled @ head.kernel + head.bias

        # timm on the same pixels, preprocessed by the server's published contract.
        batch = np.stack([Preprocessor(cfg)(p) for p in pixels]).transpose(0, 3, 1, 2)
        with torch.no_grad():
            theirs = model(torch.from_numpy(np.ascontiguousarray(batch))).numpy()
        # The served checkpoint computes with bf16 matmul inputs (the default policy).
        assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < 3e-2
        assert (ours.argmax(1) == theirs.argmax(1)).mean() >= 0.75

        out = tmp_path / "report"
        code = main(["probe", "shape-bias", "--data", str(SAMPLE), "--server", address,
                     "--head", str(ckpt / "head.npz"), "--out", str(out)])  # fmt: skip
        assert code == 0
        report = json.loads((out / "shape-bias.json").read_text())
        assert report["decisions_from"].startswith("1000-way ImageNet head mapped to 16")
        decided = report["shape_decisions"] + report["texture_decisions"]
        assert report["shape_decisions"] / max(decided, 1) == pytest.approx(report["shape_bias"])
    finally:
        server.stop()
