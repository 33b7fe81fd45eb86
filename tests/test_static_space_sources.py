"""Where a static Space's parts come from (vit_hub/hub/static_space.py): onnxruntime-web's
tarball, downloaded once into the cache and checked against npm's sha512 (served here from
127.0.0.1, offline), and the sample images, which are the model's own, named by label, or for
a model of anything but digits, none."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from bench.static_space import serve
from conftest import tiny_config
from vit_hub.data.samples import write_samples
from vit_hub.errors import UserError
from vit_hub.export import export_onnx
from vit_hub.hub import static_space
from vit_hub.hub.pretrained import HubVisionTransformer
from vit_hub.hub.static_space import ORT_WEB_VERSION, onnxruntime_web, write_static_space

ROOT = Path(__file__).resolve().parents[1]
ORT_WEB = ROOT / ".venv" / "cache" / f"onnxruntime-web-{ORT_WEB_VERSION}.tgz"  # `make install-dev` fetched it
CACHED = Path("vit_hub") / f"onnxruntime-web-{ORT_WEB_VERSION}.tgz"  # under XDG_CACHE_HOME


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A folder served on 127.0.0.1 as npm's registry, an empty cache -> (the folder, the cache)."""
    folder, cache = tmp_path / "registry", tmp_path / "cache"
    folder.mkdir()
    server = serve(folder)
    monkeypatch.setattr(static_space, "ORT_WEB_TARBALL", f"http://127.0.0.1:{server.server_address[1]}/ort.tgz")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    yield folder, cache
    server.shutdown()


def test_the_download_is_checked_and_kept_once(registry):
    folder, cache = registry
    assert ORT_WEB.is_file(), f"run `make install-dev` (it fetches {ORT_WEB.name} with npm pack)"
    (folder / "ort.tgz").symlink_to(ORT_WEB)
    assert sorted(onnxruntime_web()) == ["ort-wasm-simd-threaded.wasm", "ort.wasm.bundle.min.mjs"]
    assert (cache / CACHED).read_bytes() == ORT_WEB.read_bytes()
    (folder / "ort.tgz").unlink()  # the registry gone: the cached copy serves
    assert sorted(onnxruntime_web()) == ["ort-wasm-simd-threaded.wasm", "ort.wasm.bundle.min.mjs"]


def test_a_download_cut_while_it_is_written_leaves_nothing_under_the_cached_name(registry, monkeypatch):
    """The download is written to a partial file and renamed into place: a write that fails half-way
    (a full disk) leaves no cut tarball under the cached name, which every later Space would find
    and be refused by; the next call downloads it again."""
    folder, cache = registry
    assert ORT_WEB.is_file(), f"run `make install-dev` (it fetches {ORT_WEB.name} with npm pack)"
    (folder / "ort.tgz").symlink_to(ORT_WEB)

    def disk_full(path: Path, data: bytes) -> int:
        with open(path, "wb") as handle:
            handle.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    with monkeypatch.context() as patched:
        patched.setattr(Path, "write_bytes", disk_full)
        with pytest.raises(OSError, match="No space left on device"):
            onnxruntime_web()
    assert not (cache / CACHED).exists()
    assert sorted(onnxruntime_web()) == ["ort-wasm-simd-threaded.wasm", "ort.wasm.bundle.min.mjs"]
    assert (cache / CACHED).read_bytes() == ORT_WEB.read_bytes()
    assert [path.name for path in (cache / "vit_hub").iterdir()] == [CACHED.name]  # no partial file left


def test_a_download_that_is_not_npms_package_is_refused_and_not_kept(registry):
    """A tampered registry or mirror: the sha512 differs, so nothing reaches the cache, where
    every later Space would pick it up."""
    folder, cache = registry
    (folder / "ort.tgz").write_bytes(b"a tarball, but not the one npm publishes")
    with pytest.raises(UserError, match=r"^space --static: the download of http://127\.0\.0\.1:\d+/ort\.tgz is not "
                                        r"onnxruntime-web .* \(its sha512 differs\)$"):
        onnxruntime_web()
    assert not (cache / CACHED).exists() and list((cache / "vit_hub").iterdir()) == []


def test_a_failed_download_names_the_flag_that_avoids_it(registry):
    with pytest.raises(UserError, match=r"^space --static: expected to download onnxruntime-web .* give "
                                        r"--onnxruntime-web the file `npm pack onnxruntime-web@"):
        onnxruntime_web()  # the registry folder is empty: 404


@pytest.fixture(scope="module")
def photo_model(tmp_path_factory) -> Path:
    """A tiny RGB model of two kinds of photo, exported (pipeline.onnx), without samples/."""
    folder = tmp_path_factory.mktemp("photos") / "model"
    HubVisionTransformer(**tiny_config()).save_pretrained(folder)
    export_onnx(folder, folder)
    return folder


def test_a_photo_model_without_samples_offers_none_not_the_bundled_digits(photo_model, tmp_path):
    assert ORT_WEB.is_file(), f"run `make install-dev` (it fetches {ORT_WEB.name} with npm pack)"
    written = write_static_space(photo_model, tmp_path / "space", "me/photos", ORT_WEB)
    described = json.loads((written.folder / "model" / "model.json").read_text())
    assert described["samples"] == [] and described["digit"] is False
    assert not (written.folder / "samples").exists()


def test_a_photo_models_samples_are_its_own_named_by_label(photo_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(photo_model, model)
    rng = np.random.default_rng(0)
    photos = [(Image.fromarray(rng.integers(0, 255, (24, 32, 3), dtype=np.uint8)), index % 2) for index in range(4)]
    write_samples(photos, ["golden retriever", "../cat"], model)
    written = write_static_space(model, tmp_path / "space", "me/photos", ORT_WEB)
    described = json.loads((written.folder / "model" / "model.json").read_text())
    assert described["samples"] == ["00_golden-retriever.png", "01_cat.png", "02_golden-retriever.png", "03_cat.png"]
    for name in described["samples"]:
        assert (written.folder / "samples" / name).read_bytes() == (model / "samples" / name).read_bytes()
