"""A static Hugging Face Space: the model runs in the visitor's browser, no server at all.

`write_static_space` fills a folder with a page (`index.html`, `page.js` from vit_hub/hub/static_page),
the model's `pipeline_explain.onnx` (decoded pixels in, probabilities, the map the Gradio page
opens with for the model and attention rollout out: every preprocessing step and the map's
gradients are inside the graph; `pipeline_map.onnx`, rollout alone, for a model exported before
that graph existed; `pipeline.onnx`, probabilities only, for a model exported without
--output-attentions), `model/model.json` (title, labels, whether to offer drawing, the samples,
the graph's name), the model's sample images, and ONNX Runtime Web's WebAssembly build, vendored
in `ort/` from the npm package at ORT_WEB_VERSION (nothing is fetched from a CDN when the page
runs). The page decodes an image in the browser, runs the graph, shows the ranking and draws the
map over the image as the Gradio app does (`static_page/overlay.mjs`), naming its method (the
graph's metadata, read by `static_page/graph_method.mjs`) and the time the graph took, with
rollout as the quick choice; no image leaves the visitor's machine, and a static Space never
sleeps. The other maps (occlusion...) need the Gradio Space (`space.py`), which the page links
to when given its address.

ONNX Runtime Web comes from npm's registry once (its tarball checked against ORT_WEB_SHA512 and
kept in the user's cache), or from a tarball `npm pack onnxruntime-web@VERSION` wrote. The
folder is written as `space.write_space` writes one: beside `out`, then swapped in, replacing
only a Space folder written here and unchanged since (`space.write_folder`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tarfile
import urllib.request
from collections.abc import Callable
from pathlib import Path

from vit_hub.data.samples import BUNDLED_DIGITS, check_samples, is_digit_model, kept_samples
from vit_hub.errors import UserError
from vit_hub.hub.repos import _refuse_links_out, check_model_dir, check_repo_id
from vit_hub.hub.space import MAX_BUNDLE_BYTES, SpaceSettings, WrittenSpace, _check_out, _licence, _yaml, write_folder
from vit_hub.layout import ExportLayout, ModelDir
from vit_hub.model.config import ViTConfig

ORT_WEB_VERSION = "1.30.0"
ORT_WEB_TARBALL = f"https://registry.npmjs.org/onnxruntime-web/-/onnxruntime-web-{ORT_WEB_VERSION}.tgz"
ORT_WEB_SHA512 = "q0y+JrrtukXSzsBWEMccVfqX25LRmosXHF+CaRJmg8pZClzcV7svNc4rKY3jL02Vb7QmRMDs1SigqR4CXAfKYQ=="  # npm's integrity
ORT_WEB_FILES = ("ort.wasm.bundle.min.mjs", "ort-wasm-simd-threaded.wasm")  # the WebAssembly build, its glue inside
MAX_TARBALL_BYTES = 64 * 2**20
MAX_ORT_FILE_BYTES = 32 * 2**20
PAGE = Path(__file__).resolve().parent / "static_page"
PAGE_FILES = ("index.html", "page.js", "overlay.mjs", "graph_method.mjs")
STATIC_MODEL = "model"  # the graph and model.json inside the Space
SAMPLES = ModelDir.samples  # the sample images inside the Space, named as in a model dir
# The check of the graph before it is bundled (vit_hub.export's check_pipeline, given by the
# caller: this module never imports vit_hub.export): (graph, config, weights, a sample or None).
PipelineCheck = Callable[[Path, ViTConfig, Path, Path | None], None]


def write_static_space(model: str | Path, out: str | Path, repo_id: str, ort_web: str | Path | None = None,
                       demo_url: str | None = None, check_pipeline: PipelineCheck | None = None) -> WrittenSpace:
    """Write the static Space of the model folder `model` into `out` (new, empty, or a Space
    folder written here before and unchanged since). `repo_id` is the Space's OWNER/NAME (its
    title); `ort_web` a tarball of onnxruntime-web at ORT_WEB_VERSION (default: npm's, fetched
    once); `demo_url` the Gradio demo the page links to for maps; `check_pipeline` raises for a
    graph the page could not run (the CLI passes vit_hub.export's: see PipelineCheck)."""
    check_repo_id(repo_id, flag="--repo-id")
    model_dir, out = Path(model), Path(out)
    if not model_dir.is_dir():
        raise UserError(f"space --static: expected a model folder with pipeline_explain.onnx, pipeline_map.onnx or "
                        f"pipeline.onnx, got "
                        f"{model}; for a Hub repo, vit-hub pull it first")
    _check_out(out, model_dir)
    graph, samples = _model_files(model_dir)
    config = ViTConfig.from_json(ModelDir(model_dir).config)
    if check_pipeline is not None:
        check_pipeline(graph, config, ModelDir(model_dir).weights, samples[0] if samples else None)
    title = repo_id.split("/")[1]
    described = {"title": title, "labels": config.labels, "digit": is_digit_model(config),
                 SAMPLES: [path.name for path in samples], "demo_url": _checked_url(demo_url),
                 "graph": graph.name}  # the page reads them
    copies = {**{name: PAGE / name for name in PAGE_FILES}, f"{STATIC_MODEL}/{graph.name}": graph,
              **{f"{SAMPLES}/{path.name}": path for path in samples}}
    contents = {**{f"ort/{name}": data for name, data in onnxruntime_web(ort_web).items()},
                f"{STATIC_MODEL}/model.json": json.dumps(described, indent=2) + "\n",
                ModelDir.card: _readme(title, _licence(ModelDir(model_dir).card), graph.name)}
    return write_folder(out, copies, contents, SpaceSettings(STATIC_MODEL, None, backend="browser"))


def _model_files(model_dir: Path) -> tuple[Path, list[Path]]:
    """(the first of pipeline_explain.onnx, pipeline_map.onnx and pipeline.onnx the folder has; the
    sample images) of a model folder, none a link out of it, every sample one the model answers
    (`check_samples`)."""
    layout = ExportLayout.for_model(model_dir)
    graph = next((path for path in (layout.pipeline_explain, layout.pipeline_map) if os.path.lexists(path)),
                 layout.pipeline)
    _refuse_links_out(model_dir, [ModelDir.config, graph.name], flag="space MODEL")
    check_model_dir(model_dir, flag="space MODEL")
    if not graph.is_file():
        raise FileNotFoundError(f"space --static: expected {graph.name} in {model_dir}, found none; export "
                                f"it first: python -m vit_hub.export --model {model_dir} --out {model_dir}")
    size = graph.stat().st_size
    if size > MAX_BUNDLE_BYTES:
        raise UserError(f"space --static: expected {graph.name} of at most {MAX_BUNDLE_BYTES // 2**20} MB, "
                        f"a page's download, got {size / 2**20:.0f} MB in {model_dir}")
    config = ViTConfig.from_json(ModelDir(model_dir).config)
    samples = kept_samples(model_dir) or (sorted(BUNDLED_DIGITS.glob("*.png")) if is_digit_model(config) else [])
    check_samples(samples, config, flag="space --static")  # before the graph runs on the first
    return graph, samples


def _checked_url(url: str | None) -> str | None:
    if url is not None and not url.startswith("https://"):
        raise UserError(f"--demo-url: expected an https:// address, got {url!r}")
    return url


def _readme(title: str, licence: str, graph: str) -> str:
    """The Space's README.md; `graph` is the name of the graph it bundles."""
    front = {"title": title, "sdk": "static", "app_file": "index.html", "license": licence, "pinned": False,
             "tags": ["vit_hub", "onnxruntime-web", "image-classification"]}
    return (f"---\n{_yaml(front)}---\n\n# {title}\n\nA vit_hub Vision Transformer that runs in your browser: "
            f"`{STATIC_MODEL}/{graph}` takes an image's pixels and does all of the model's preprocessing, ONNX "
            f"Runtime Web {ORT_WEB_VERSION} (WebAssembly, in `ort/`) runs it, and no image leaves your machine.\n\n"
            f"Written by `vit-hub space --static`.\n")


# ONNX Runtime Web ----------------------------------------------------------------------------
def onnxruntime_web(tarball: str | Path | None = None) -> dict[str, bytes]:
    """The files of ORT_WEB_FILES from onnxruntime-web's npm tarball: `tarball`, or npm's,
    downloaded once into the cache; either must match ORT_WEB_SHA512."""
    path = Path(tarball) if tarball is not None else _cached_tarball()
    if not path.is_file():
        raise FileNotFoundError(f"--onnxruntime-web: expected the tarball of `npm pack onnxruntime-web@{ORT_WEB_VERSION}`, "
                                f"found nothing at {path}")
    if path.stat().st_size > MAX_TARBALL_BYTES:
        raise UserError(f"--onnxruntime-web: expected at most {MAX_TARBALL_BYTES // 2**20} MB, got "
                        f"{path.stat().st_size // 2**20} MB in {path}")
    data = path.read_bytes()
    if _integrity(data) != ORT_WEB_SHA512:
        raise UserError(f"--onnxruntime-web: expected onnxruntime-web {ORT_WEB_VERSION} (sha512 {ORT_WEB_SHA512[:16]}...), "
                        f"got another file at {path}")
    return _read_members(path)


def _integrity(data: bytes) -> str:
    return base64.b64encode(hashlib.sha512(data).digest()).decode()


def _read_members(path: Path) -> dict[str, bytes]:
    """The named files of the package's dist/ folder, read without extracting anything else."""
    wanted = {f"package/dist/{name}": name for name in ORT_WEB_FILES}
    found = {}
    with tarfile.open(path, "r:gz") as archive:
        for member in archive:
            if member.name in wanted and member.isfile() and member.size <= MAX_ORT_FILE_BYTES:
                found[wanted[member.name]] = archive.extractfile(member).read()
    missing = sorted(set(ORT_WEB_FILES) - set(found))
    if missing:
        raise UserError(f"--onnxruntime-web: expected {', '.join(missing)} in {path}, found none")
    return found


def _cached_tarball() -> Path:
    """npm's tarball of ORT_WEB_VERSION in the user's cache, downloaded (and checked) the first time."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vit_hub"
    path = cache / f"onnxruntime-web-{ORT_WEB_VERSION}.tgz"
    if path.is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    try:
        with urllib.request.urlopen(ORT_WEB_TARBALL, timeout=60) as response:
            data = response.read(MAX_TARBALL_BYTES + 1)
    except OSError as error:
        raise UserError(f"space --static: expected to download onnxruntime-web from {ORT_WEB_TARBALL}, got "
                        f"{error}; or give --onnxruntime-web the file `npm pack onnxruntime-web@{ORT_WEB_VERSION}` "
                        f"writes") from None
    if _integrity(data) != ORT_WEB_SHA512:
        raise UserError(f"space --static: the download of {ORT_WEB_TARBALL} is not onnxruntime-web {ORT_WEB_VERSION} "
                        f"as npm publishes it (its sha512 differs)")
    partial = path.with_suffix(".partial")
    partial.write_bytes(data)
    os.replace(partial, path)
    return path
