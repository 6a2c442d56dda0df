"""Models named on the Hugging Face Hub (``ORG/NAME``, ``hf-hub:ORG/NAME[@REV]``), read from a hub
cache that each test lays out itself in tmp_path exactly as huggingface_hub does (content-addressed
blobs, a snapshot of links per commit, refs naming commits), from tiny models saved by the
source's own code; HF_HUB_OFFLINE=1, as the test machines have no hub. Converted by name, they
equal the source's forward (tests/parity.py), and the checkpoint records the repo and commit.

Downloading is checked against ``LocalHub``, a stand-in for the hub's HTTP API on 127.0.0.1 (the
few routes huggingface_hub's snapshot_download and model_info call), started and stopped by the
test: huggingface_hub's own client downloads into the cache."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import jax
import numpy as np
import pytest
import torch
from parity import check_parity
from peers import import_open_clip, perturb
from safetensors.torch import save_file
from test_backbones import HF_CASES, OPEN_CLIP_CFG, TIMM_SHAPE, _hf, _pixels, timm
from timm.models._hub import save_config_for_hf
from vit22b.clients.cli import main
from vit22b.model import checkpoint as ckpt
from vit22b.model.convert import ConvertError, convert
from vit22b.model.convert_common import BIN_SHARD_INDEX, SHARD_INDEX, byte_size, index_shards
from vit22b.model.sharding import available_memory


def cache_repo(cache: Path, repo: str, files: Path, ref: str = "main", commit: str = "") -> str:
    """Lay ``files``' contents out as the hub cache keeps ``repo`` at ``commit`` (named by
    ``ref``): blobs by content hash, snapshot entries linking to them. Returns the commit."""
    commit = commit or hashlib.sha1(f"{repo}@{ref}".encode()).hexdigest()
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for file in sorted(files.iterdir()):
        data = file.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    return commit


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hf_model_by_name_from_the_cache(hub_cache, tmp_path, capsys):
    """`--from hf --input ORG/NAME`: transformers' own loader reads the same cache to the same
    model, and the conversion equals its forward; `source` is the repo at its commit."""
    import transformers

    cls_name, config_name, kw, outputs, normed, _ = HF_CASES["dinov2-registers"]
    model = _hf(cls_name, config_name, seed=61, **kw)
    model.save_pretrained(tmp_path / "saved")
    commit = cache_repo(hub_cache, "acme/dinov2-reg-tiny", tmp_path / "saved")

    peer = (
        getattr(transformers, cls_name)
        .from_pretrained("acme/dinov2-reg-tiny", cache_dir=hub_cache, local_files_only=True)
        .eval()
    )
    converted = convert("hf", "acme/dinov2-reg-tiny")
    assert converted.source == f"hf:acme/dinov2-reg-tiny@{commit}"
    pixels = _pixels()
    with torch.no_grad():
        expected = {k: v.numpy() for k, v in outputs(model, pixels).items()}
        got = {k: v.numpy() for k, v in outputs(peer, pixels).items()}
    assert all((got[k] == expected[k]).all() for k in expected)  # the cache is the model
    check_parity(
        "hub-hf-dinov2-registers", f"hf {cls_name}", converted, pixels.numpy(), got, normed
    )

    out = tmp_path / "ckpt"
    assert (
        main(["convert", "--from", "hf", "--input", "acme/dinov2-reg-tiny", "--out", str(out)]) == 0
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["source"] == f"hf:acme/dinov2-reg-tiny@{commit}"
    assert ckpt.read_metadata(out).source == summary["source"]


def test_timm_hf_hub_name_reads_the_preferred_weights_at_a_revision(hub_cache, tmp_path):
    """`hf-hub:ORG/NAME@REV`, as timm spells it: the revision is a ref or a commit; of the weight
    files a timm repo keeps, model.safetensors is read (the .bin beside it is garbage here)."""
    name = "vit_base_patch14_reg4_dinov2"
    model = timm.create_model(name, pretrained=False, **TIMM_SHAPE, num_classes=0).eval()
    perturb(model, seed=62)
    saved = tmp_path / "saved"
    saved.mkdir()
    save_file(model.state_dict(), str(saved / "model.safetensors"))
    save_config_for_hf(model, str(saved / "config.json"))
    (saved / "pytorch_model.bin").write_bytes(b"not read")
    main_commit = cache_repo(hub_cache, "timm/tiny-reg4", saved)
    v1 = cache_repo(hub_cache, "timm/tiny-reg4", saved, ref="v1", commit="1" * 40)

    pixels = _pixels()
    with torch.no_grad():
        tokens = model.forward_features(pixels)
        peer = {
            "pooled": model.forward_head(tokens, pre_logits=True).numpy(),
            "patch_tokens": tokens[:, 5:].numpy(),
            "register_tokens": tokens[:, 1:5].numpy(),
        }
    for spec, commit in (
        ("hf-hub:timm/tiny-reg4", main_commit),
        ("hf-hub:timm/tiny-reg4@v1", v1),
        (f"hf-hub:timm/tiny-reg4@{v1}", v1),
    ):
        converted = convert("timm", spec)
        assert converted.source == f"timm:hf-hub:timm/tiny-reg4@{commit}"
        assert converted.config.num_registers == 4
    check_parity("hub-timm-dinov2-reg4", f"timm {name}", converted, pixels.numpy(), peer, True)
    assert converted.preprocess_from == "config.json pretrained_cfg"


def test_open_clip_hf_hub_name(hub_cache, tmp_path):
    open_clip = import_open_clip()
    model = open_clip.model.CLIP(**OPEN_CLIP_CFG).eval()
    perturb(model, seed=63)
    saved = tmp_path / "saved"
    saved.mkdir()
    torch.save(model.state_dict(), saved / "open_clip_pytorch_model.bin")
    config = {"model_cfg": OPEN_CLIP_CFG, "preprocess_cfg": {"mean": [0.4] * 3, "std": [0.3] * 3}}
    (saved / "open_clip_config.json").write_text(json.dumps(config))
    commit = cache_repo(hub_cache, "acme/clip-tiny", saved)
    converted = convert("open_clip", "hf-hub:acme/clip-tiny")
    assert converted.source == f"open_clip:hf-hub:acme/clip-tiny@{commit}"
    assert converted.config.preprocess.mean == (0.4, 0.4, 0.4)
    pixels = _pixels()
    with torch.no_grad():
        peer = {"pooled": model.encode_image(pixels).numpy()}
    check_parity("hub-open_clip", "open_clip CLIP", converted, pixels.numpy(), peer, True)


def test_a_model_neither_cached_nor_downloadable_names_the_repo_and_the_cache(hub_cache, tmp_path):
    folder = hub_cache / "models--acme--absent"
    with pytest.raises(ConvertError) as err:
        convert("hf", "acme/absent")
    assert str(err.value) == (
        f"acme/absent: no such local path, and revision 'main' is not in the Hugging Face cache "
        f"({folder}), and HF_HUB_OFFLINE forbids downloading it"
    )
    with pytest.raises(ConvertError, match=r"hf-hub:timm/absent: revision 'v2' is not in the"):
        convert("timm", "hf-hub:timm/absent@v2")
    # huggingface_hub reads refs/REVISION as a file: "../" read any file's first line as a
    # commit, and a folder was "Is a directory"
    for revision in ("../../evil", "/etc", "a b", "x\ny", "refs/../main"):
        with pytest.raises(ConvertError, match=re.escape(
                f"hf-hub:timm/absent: revision {revision!r} is not a branch, tag or commit name")):
            convert("timm", f"hf-hub:timm/absent@{revision}")

    # cached, but without any weight file the importer reads
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "config.json").write_text("{}")
    cache_repo(hub_cache, "acme/config-only", saved)
    with pytest.raises(
        ConvertError,
        match="its cached snapshot holds none of model.safetensors, "
        "model.safetensors.index.json, pytorch_model.bin",
    ):
        convert("hf", "acme/config-only")

    with pytest.raises(ConvertError, match="not a hub model name"):
        convert("timm", "hf-hub:not a name")
    with pytest.raises(ConvertError, match="hub models are read for --from hf, timm, open_clip"):
        convert("big_vision", "hf-hub:google/some-npz")


def test_an_existing_local_path_is_never_a_hub_name(hub_cache, tmp_path, monkeypatch):
    cls_name, config_name, kw, *_ = HF_CASES["clip"]
    _hf(cls_name, config_name, seed=64, **kw).save_pretrained(tmp_path / "acme" / "clip")
    monkeypatch.chdir(tmp_path)
    converted = convert("hf", "acme/clip")  # nothing of that name in the cache: read locally
    assert converted.source == "hf:clip"


class LocalHub:
    """The hub's HTTP API for ``repos`` ({repo: (commit, folder)}) on 127.0.0.1: model info,
    the file tree, and files by commit (HEAD and GET); ``requests`` logs every (method, path)."""

    def __init__(self, repos: dict[str, tuple[str, Path]], declared: dict[str, int] | None = None):
        self.repos = repos
        self.declared = declared or {}  # sizes the metadata states in place of the files' own
        self.requests: list[tuple[str, str]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> LocalHub:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fetched(self) -> list[str]:
        """The files downloaded (GET), by name."""
        return sorted(
            p.rsplit("/", 1)[-1] for m, p in self.requests if m == "GET" and "/resolve/" in p
        )

    def _sibling(self, folder: Path, name: str, blobs: bool) -> dict:
        """A file as model_info lists it: with ``?blobs=true`` its size, and a weight file's LFS
        object (the hub keeps weights in LFS)."""
        if not blobs:
            return {"rfilename": name}
        size = self.declared.get(name, (folder / name).stat().st_size)
        lfs = {"size": size, "sha256": "0" * 64, "pointerSize": 134}
        return {"rfilename": name, "size": size, "blobId": "0" * 40,
                **({"lfs": lfs} if name.endswith((".safetensors", ".bin")) else {})}

    def _answer(self, method: str, path: str, query: str = "") -> tuple[int, bytes, dict]:
        self.requests.append((method, path))
        if m := re.match(r"^/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)$", path):
            repo, kind, _ = m.groups()
            if repo not in self.repos:
                return 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}
            commit, folder = self.repos[repo]
            files = sorted(p.name for p in folder.iterdir())
            if kind == "revision":
                blobs = "blobs=true" in query.lower()
                body = {"id": repo, "sha": commit,
                        "siblings": [self._sibling(folder, f, blobs) for f in files]}
            else:
                body = [
                    {"type": "file", "path": f, "size": (folder / f).stat().st_size, "oid": f}
                    for f in files
                ]
            return 200, json.dumps(body).encode(), {"Content-Type": "application/json"}
        if m := re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path):
            commit, folder = self.repos[m[1]]
            data = (folder / m[3]).read_bytes()
            etag = f'"{hashlib.sha256(data).hexdigest()}"'
            return 200, data, {"X-Repo-Commit": commit, "ETag": etag}
        return 404, b"", {}

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self._reply(head=True)

            def do_GET(self) -> None:
                self._reply(head=False)

            def _reply(self, head: bool) -> None:
                url = urlparse(self.path)
                code, body, headers = hub._answer(self.command, unquote(url.path), url.query)
                self.send_response(code)
                for key, value in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(key, value)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

        return Handler


def test_weights_too_large_for_the_cache_or_the_memory_are_refused_before_downloading(
        tmp_path, monkeypatch):
    """A hub model was downloaded whole before the converter found it larger than the memory
    (or failed mid-download on a full disk). The files' sizes are asked first now (the hub's
    metadata, as model_info gives them with ``files_metadata``), and a model the cache's disk
    or the converter's memory cannot hold is refused with nothing downloaded; the sizes of a
    sharded model's shards are summed."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shards = [f"model-0000{k}-of-00002.safetensors" for k in (1, 2)]
    for name in ("config.json", "model.safetensors", *shards):
        (repo / name).write_bytes(b"{}")
    (repo / SHARD_INDEX).write_text(json.dumps({"weight_map": dict(zip("ab", shards))}))
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with LocalHub({"acme/huge": ("d" * 40, repo)}, {"model.safetensors": 2**50}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(ConvertError, match=r"acme/huge \(revision 'main'\): its weight files "
                           r"take 1\.0 PiB to download, and the Hugging Face cache \(.*hub\) "
                           r"has [\d.]+ \w+ free; no weight file was downloaded"):
            convert("hf", "acme/huge")
        assert hub.fetched() == []

    have, free = available_memory(), shutil.disk_usage(tmp_path).free
    if have is None or have + 2**31 >= free:
        pytest.skip(f"{have} bytes of memory, {free} of disk: no size between them")
    (repo / "model.safetensors").unlink()  # the shards, then, each half of more than memory
    half = have // 2 + 2**30
    declared = dict.fromkeys(shards, half)
    with LocalHub({"acme/huge": ("d" * 40, repo)}, declared) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(ConvertError, match=r"acme/huge \(revision 'main'\): its weight files "
                           r"take .* GiB, read whole, and .* GiB of memory is available: "
                           r"converting it needs a host with more memory; no weight file was "
                           "downloaded"):
            convert("hf", "acme/huge")
        assert hub.fetched() == ["config.json", SHARD_INDEX]  # the index, to name the shards


class OddHub(LocalHub):
    """A hub (or a mirror) whose file metadata is ``sibling(name)`` for the weights."""

    def __init__(self, repos, sibling):
        super().__init__(repos)
        self.odd = sibling

    def _sibling(self, folder: Path, name: str, blobs: bool) -> dict:
        plain = super()._sibling(folder, name, blobs)
        return self.odd(name) if name.endswith(".safetensors") else plain


def test_byte_sizes_in_messages_take_the_unit_that_fits():
    sizes = (0, 1023, 1024, 2**20 - 1, 3 * 2**20, 2**50, 5 * 2**70)
    assert [byte_size(n) for n in sizes] == ["0 B", "1023 B", "1.0 KiB", "1.0 MiB", "3.0 MiB",
                                             "1.0 PiB", "5120.0 EiB"]


def test_odd_file_metadata_and_cache_paths_are_named(tmp_path, monkeypatch):
    """An outside tester's finds: a malformed LFS entry was "downloading it failed: KeyError:
    'sha256'"; a size JSON gives as 1e+30 (a float) counted as unknown and the file was
    fetched; a cache under ``~user`` ended in a bare RuntimeError from huggingface_hub."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("config.json", "model.safetensors"):
        (repo / name).write_bytes(b"{}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    repos = {"acme/odd": ("f" * 40, repo)}
    for sibling, message in (
        (lambda n: {"rfilename": n, "lfs": {"size": 3}}, r"the hub's description of revision "
         r"'main' is malformed \(KeyError: 'sha256'\); no weight file was downloaded"),
        (lambda n: {"rfilename": n, "size": 1e30}, r"its weight files take [\d.]+ EiB to "
         "download"),
        (lambda n: {"rfilename": n, "size": -1, "lfs": {"size": 1e30, "sha256": "0" * 64,
                                                        "pointerSize": 1}}, "EiB to download"),
    ):
        with OddHub(repos, sibling) as hub:
            monkeypatch.setenv("HF_ENDPOINT", hub.url)
            with pytest.raises(ConvertError, match=message):
                convert("hf", "acme/odd")
            assert hub.fetched() == []
    monkeypatch.setenv("HF_HUB_CACHE", "~no-such-user-vit22b/hub")
    with pytest.raises(ConvertError, match="HF_HUB_CACHE='~no-such-user-vit22b/hub': "
                       "~no-such-user-vit22b names no user's home folder here"):
        convert("hf", "acme/odd")


class FilesGone(LocalHub):
    """A hub that lists its repositories but answers 404 for every file."""

    def _answer(self, method: str, path: str, query: str = "") -> tuple[int, bytes, dict]:
        if "/resolve/" in path:
            self.requests.append((method, path))
            return 404, b"", {"X-Error-Code": "EntryNotFound"}
        return super()._answer(method, path, query)


def test_a_hub_whose_files_fail_leaves_the_cache_as_it_was(tmp_path, monkeypatch, caplog):
    """An outside tester's finds: the hub's `main` moved to a commit whose files then failed
    to download; the cached commit converted (warned), but huggingface_hub had already moved
    `refs/main` to the new commit, so every later offline run refused the model. The ref is
    put back. A snapshot lacking a shard whose download failed was "not in the cache": the
    refusal names the missing file."""
    cls_name, config_name, kw, *_ = HF_CASES["siglip"]
    folder = tmp_path / "v1"
    _hf(cls_name, config_name, seed=68, **kw).save_pretrained(folder)
    cache = tmp_path / "hub"
    old = cache_repo(cache, "acme/moved", folder, commit="a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with FilesGone({"acme/moved": ("b" * 40, folder)}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with caplog.at_level("WARNING", logger="vit22b.model.hub"):
            assert convert("hf", "acme/moved").source == f"hf:acme/moved@{old}"
        assert "asking the hub failed" in caplog.text
    assert (cache / "models--acme--moved" / "refs" / "main").read_text() == old
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert convert("hf", "acme/moved").source == f"hf:acme/moved@{old}"

    sharded = tmp_path / "sharded"
    _hf(cls_name, config_name, seed=68, **kw).save_pretrained(sharded, max_shard_size="40KB")
    shards = index_shards(sharded / SHARD_INDEX)
    cut = tmp_path / "cut"  # cached without its last shard
    shutil.copytree(sharded, cut)
    (cut / shards[-1]).unlink()
    commit = cache_repo(cache, "acme/cut", cut, commit="c" * 40)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with FilesGone({"acme/cut": (commit, sharded)}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(ConvertError, match=f"acme/cut: no such local path, and its cached "
                           f"snapshot lacks {shards[-1]} \\(a download cut short\\?\\) .*and "
                           "downloading it failed: .*404"):
            convert("hf", "acme/cut")


def test_a_sharded_model_fetches_the_shards_its_index_names_and_completes_a_cut_short_download(
        tmp_path, monkeypatch):
    """transformers' sharded safetensors: the index first, then the shards it names, not every
    file the shard pattern matches (a repository may keep an earlier sharding's files). A
    snapshot cut short (the index and some shards) passed as complete, online or not, and the
    converter failed on the missing file: online it is completed now, the missing shard
    alone fetched; offline it is named. An index naming a file the repository lacks is refused
    before any weight is fetched."""
    cls_name, config_name, kw, outputs, normed, _ = HF_CASES["siglip"]
    model = _hf(cls_name, config_name, seed=66, **kw)
    repo = tmp_path / "repo"
    model.save_pretrained(repo, max_shard_size="40KB")
    named = json.loads((repo / SHARD_INDEX).read_text())["weight_map"]
    shards = sorted(set(named.values()))
    assert len(shards) > 2
    (repo / "model-00001-of-00009.safetensors").write_bytes(b"an earlier sharding's file")
    # transformers reads the shards before a pickle beside them (the hub fetched the pickle)
    (repo / "pytorch_model.bin").write_bytes(b"another format")
    cache, commit = tmp_path / "hub", "e" * 40
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    pixels = _pixels()
    with torch.no_grad():
        peer = {k: v.numpy() for k, v in outputs(model, pixels).items()}
    with LocalHub({"acme/sharded": (commit, repo)}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        converted = convert("hf", "acme/sharded")
        assert hub.fetched() == sorted(["config.json", SHARD_INDEX, *shards])
        check_parity("hub-download-sharded", f"hf {cls_name}", converted, pixels.numpy(), peer,
                     normed)

        link = cache / "models--acme--sharded" / "snapshots" / commit / shards[1]
        link.resolve().unlink()  # as a download cut short leaves it: neither blob nor link
        link.unlink()
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        with pytest.raises(ConvertError, match=f"its cached snapshot lacks {shards[1]} "
                           r"\(a download cut short\?\) .*HF_HUB_OFFLINE forbids"):
            convert("hf", "acme/sharded")
        monkeypatch.delenv("HF_HUB_OFFLINE")
        before = Counter(hub.fetched())
        assert convert("hf", "acme/sharded").source == converted.source
        assert Counter(hub.fetched()) - before == Counter([shards[1]])  # the missing one alone

        # a folder (or a snapshot) holding model.safetensors and an index: the single file, as
        # transformers reads them (the index's shards were read: another model, by what else
        # was cached)
        single = _hf(cls_name, config_name, seed=67, **kw)
        both = tmp_path / "both"
        single.save_pretrained(both)
        for name in (SHARD_INDEX, *shards):
            (both / name).write_bytes((repo / name).read_bytes())
        with torch.no_grad():
            peer_single = {k: v.numpy() for k, v in outputs(single, pixels).items()}
        check_parity("hub-both-single-wins", f"hf {cls_name}", convert("hf", str(both)),
                     pixels.numpy(), peer_single, normed)
        # an index naming a tensor no shard holds was read as that tensor absent (a patch bias
        # dropped: another model, no word); a shard name with a glob character fetched others
        index = json.loads((repo / SHARD_INDEX).read_text())
        for edit, message in (
            ({**named, "extra.weight": shards[0]},
             r"names tensors no shard holds \('extra.weight'\)"),
            ({**named, "x": "model-[1]-of-00007.safetensors"}, "weight_map names "
             r"'model-\[1\]-of-00007.safetensors', not a .safetensors file in its folder"),
            ({**named, "x": "config.json"}, "weight_map names 'config.json', not a .safetensors"),
        ):
            (both / "model.safetensors").unlink(missing_ok=True)
            (both / SHARD_INDEX).write_text(json.dumps({**index, "weight_map": edit}))
            with pytest.raises(ConvertError, match=message):
                convert("hf", str(both))

        (repo / shards[0]).unlink()  # the hub no longer holds a file its index names
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub2"))
        with pytest.raises(ConvertError, match=f"its {SHARD_INDEX} names {shards[0]}, which the "
                           "repository does not hold; no weight file was downloaded"):
            convert("hf", "acme/sharded")


def save_sharded_pickles(model, folder: Path, max_shard_size: str = "40KB") -> list[str]:
    """``model`` as transformers before 4.35 saved a large one (``save_pretrained`` of pickles:
    ``pytorch_model-0000k-of-0000n.bin`` and their ``pytorch_model.bin.index.json``), which
    current transformers still reads and no longer writes. Returns the shards' names."""
    from huggingface_hub import split_torch_state_dict_into_shards

    state = model.state_dict()
    split = split_torch_state_dict_into_shards(
        state, filename_pattern="pytorch_model{suffix}.bin", max_shard_size=max_shard_size)
    folder.mkdir(parents=True)
    model.config.save_pretrained(folder)
    for name, keys in split.filename_to_tensors.items():
        torch.save({key: state[key].contiguous() for key in keys}, folder / name)
    index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    (folder / BIN_SHARD_INDEX).write_text(json.dumps(index))
    return sorted(split.filename_to_tensors)


def test_a_model_sharded_in_pickles_converts_locally_and_by_name(tmp_path, monkeypatch):
    """transformers' older sharded saves (``pytorch_model.bin.index.json`` and ``.bin`` shards,
    as large models on the hub still are) were "expected one weight file, found: ..." locally
    and "holds none of the weight files this importer reads" by name. Read now in transformers'
    order (after model.safetensors, its index and pytorch_model.bin), equal to the peer's own
    load of the same folder; by name, the index and the shards it names are all that is
    fetched."""
    import transformers

    cls_name, config_name, kw, outputs, normed, _ = HF_CASES["dinov2-registers"]
    repo = tmp_path / "repo"
    shards = save_sharded_pickles(_hf(cls_name, config_name, seed=69, **kw), repo)
    assert len(shards) > 2
    pixels = _pixels()
    peer = getattr(transformers, cls_name).from_pretrained(repo).eval()  # its reader, its files
    with torch.no_grad():
        want = {k: v.numpy() for k, v in outputs(peer, pixels).items()}
    check_parity("bin-shards-local", f"hf {cls_name}", convert("hf", repo), pixels.numpy(),
                 want, normed)
    alone = convert("hf", repo / BIN_SHARD_INDEX).params  # the index names its shards
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, alone,
                                                         convert("hf", repo).params))
    (repo / SHARD_INDEX).symlink_to(tmp_path / "gone.json")  # skipped, as transformers does
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, alone,
                                                         convert("hf", repo).params))
    (repo / SHARD_INDEX).unlink()
    with pytest.raises(ConvertError, match=f"{shards[0]}: one shard of the checkpoint its "
                       f"folder's {re.escape(BIN_SHARD_INDEX)} names: convert the folder"):
        convert("hf", repo / shards[0])

    (repo / "pytorch_model-00001-of-00009.bin").write_bytes(b"an earlier sharding's file")
    cache, commit = tmp_path / "hub", "f" * 40
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with LocalHub({"acme/pickled": (commit, repo)}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        converted = convert("hf", "acme/pickled")
        assert hub.fetched() == sorted(["config.json", BIN_SHARD_INDEX, *shards])
        check_parity("bin-shards-hub", f"hf {cls_name}", converted, pixels.numpy(), want, normed)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache alone, and complete
    assert convert("hf", "acme/pickled").source == converted.source

    index = json.loads((repo / BIN_SHARD_INDEX).read_text())
    named = index["weight_map"]
    (repo / BIN_SHARD_INDEX).write_text(json.dumps(
        {**index, "weight_map": {**named, "x": "model-00001-of-00001.safetensors"}}))
    with pytest.raises(ConvertError, match="weight_map names 'model-00001-of-00001.safetensors', "
                       r"not a \.bin file in its folder"):
        convert("hf", repo)
    (repo / BIN_SHARD_INDEX).write_text(json.dumps(index))
    (repo / "pytorch_model.bin").write_bytes(b"not read")  # a single file beside it wins
    with pytest.raises(ConvertError, match="pytorch_model.bin: "):
        convert("hf", repo)
    (repo / "pytorch_model.bin").unlink()  # an index that is a link to nothing, named
    (repo / BIN_SHARD_INDEX).unlink()
    (repo / BIN_SHARD_INDEX).symlink_to(tmp_path / "gone.json")
    with pytest.raises(ConvertError, match=f"{re.escape(BIN_SHARD_INDEX)}: not a regular file"):
        convert("hf", repo)


def test_a_model_not_in_the_cache_is_downloaded_where_a_hub_is_reachable(tmp_path, monkeypatch,
                                                                         caplog):
    """Only the files the importer reads are fetched (config files and the preferred weights,
    not the .bin beside them); the second conversion reads the cache (online, the hub is asked
    which files it holds, nothing is fetched again); a cache holding another of its files is
    completed with the preferred one; an unknown repository is named; with the hub gone, a
    cached model converts with a warning, an uncached one is refused naming why."""
    cls_name, config_name, kw, outputs, normed, _ = HF_CASES["siglip"]
    model = _hf(cls_name, config_name, seed=65, **kw)
    model.save_pretrained(tmp_path / "repo")
    (tmp_path / "repo" / "pytorch_model.bin").write_bytes(b"the same weights, another format")
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    commit = "c" * 40
    pixels = _pixels()
    with torch.no_grad():
        peer = {k: v.numpy() for k, v in outputs(model, pixels).items()}
    with LocalHub({"acme/siglip-tiny": (commit, tmp_path / "repo")}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        converted = convert("hf", "acme/siglip-tiny")
        assert hub.fetched() == ["config.json", "model.safetensors"]
        assert converted.source == f"hf:acme/siglip-tiny@{commit}"
        assert (cache / "models--acme--siglip-tiny" / "snapshots" / commit / "config.json").exists()
        check_parity(
            "hub-download-hf-siglip", f"hf {cls_name}", converted, pixels.numpy(), peer, normed
        )

        asked = len(hub.requests)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        assert convert("hf", "acme/siglip-tiny").source == converted.source
        assert len(hub.requests) == asked  # offline: the cache alone
        monkeypatch.delenv("HF_HUB_OFFLINE")
        assert convert("hf", "acme/siglip-tiny").source == converted.source
        assert hub.fetched() == ["config.json", "model.safetensors"]  # asked, nothing fetched

        # a cache an earlier tool left with the .bin alone: online, the file the importer
        # prefers is fetched and read (the cached .bin was read: another file than a fresh
        # cache's, here not even a checkpoint); offline, the cache as it is
        other = tmp_path / "other-cache"
        left = tmp_path / "left"
        left.mkdir()
        for name in ("config.json", "pytorch_model.bin"):
            (left / name).write_bytes((tmp_path / "repo" / name).read_bytes())
        cache_repo(other, "acme/siglip-tiny", left, commit=commit)
        monkeypatch.setenv("HF_HUB_CACHE", str(other))
        again = convert("hf", "acme/siglip-tiny")
        assert hub.fetched() == ["config.json", "model.safetensors", "model.safetensors"]
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(again.params),
                                                        jax.tree.leaves(converted.params)))
        monkeypatch.setenv("HF_HUB_CACHE", str(cache))

        with pytest.raises(
            ConvertError,
            match=r"acme/absent: no such local path, and revision "
            r"'main' is not in the Hugging Face cache \(.*models--acme--absent\), "
            r"and downloading it failed: RepositoryNotFoundError",
        ):
            convert("hf", "acme/absent")
    # the hub has stopped: a cached snapshot holding weights is read as it is, with a warning
    with caplog.at_level("WARNING", logger="vit22b.model.hub"):
        assert convert("hf", "acme/siglip-tiny").source == converted.source
    assert "asking the hub failed (ConnectError" in caplog.text

    with pytest.raises(
        ConvertError,
        match=r"hf-hub:timm/gone: revision 'main' is not in the "
        r"Hugging Face cache .* downloading it failed: ConnectError",
    ):
        convert("timm", "hf-hub:timm/gone")  # the hub has stopped
