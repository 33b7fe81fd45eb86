"""A Hugging Face Space that demos a vit_hub model with this project's Gradio app.

`write_space` fills a folder with what a Gradio Space runs: an `app.py` that starts
`vit_hub.demo`, the sources of the `vit_hub` package copied from where it runs (installed or
a checkout; a Space cannot install them from anywhere else; `vit_hub.export` goes to
`vit_hub/export/`, where its import name finds it with no install) with its bundled sample
digits, `requirements.txt`, a README whose front matter tells the Hub how to run it, and
`space.json`, which names the model `app.py` serves when it starts with no flags:

  - a model folder is bundled into the Space (`model/`, with its sample images; small models,
    see MAX_BUNDLE_BYTES);
  - a Hub repo id is pulled when the Space starts, pinned to the commit it had when the
    Space was written, so a later push to the model repo does not change the demo.

The Space runs the app's ONNX backend: no torch to install (the Space builds and starts
faster, and a CPU Space has no use for it), so the model needs its ONNX graphs
(`python -m vit_hub.export --output-attentions`, or `vit-hub push --with-onnx` for a repo).
The methods that need gradients are not offered there.

`push_space` uploads the folder as a Space repo in one commit. This module never imports
vit_hub.export (imports point app -> export -> vit_hub); it finds its files.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from huggingface_hub import HfApi, RepoCard

from vit_hub.data.samples import BUNDLED_DIGITS, check_samples, kept_samples
from vit_hub.errors import UserError
from vit_hub.hub.card import HUB_TAGS
from vit_hub.hub.repos import (DEFAULT_BRANCH, _push_token, _refuse_links_out, check_config,
                               check_model_dir, check_repo_id, fetch_file, has_file, hub_endpoint, hub_errors)
from vit_hub.hub.space_folder import (MARKER_FILE, MAX_MARKER_BYTES, check_name, finish_leftovers, held_staging,
                                      intent_marker, sha256, swap_in)
from vit_hub.layout import PUBLISHED_FILES, ExportLayout, ModelDir
from vit_hub.model.config import ViTConfig
from vit_hub.storage import read_card

SETTINGS_FILE = "space.json"  # in the Space folder: the model app.py serves and how
# The check the Space's app runs on a graph before a session opens it (vit_hub.export's
# check_graph), given by the caller: this module never imports vit_hub.export.
GraphCheck = Callable[[Path, ViTConfig], None]
MODEL_FOLDER = "model"  # a bundled model's folder inside the Space
BACKEND = "onnx"  # torch-free: see the module docstring
MAX_BUNDLE_BYTES = 100 * 2**20  # larger models are pulled from their Hub repo instead
MAX_SETTINGS_BYTES = 64 * 2**10
# What the app reads of a model dir beyond what a push uploads: the page's faithfulness line
# (written by bench/faithfulness.py --write).
APP_EXTRA_FILES = (ModelDir.faithfulness,)
PACKAGE = Path(__file__).resolve().parents[1]  # vit_hub, installed or in a checkout
SPACE_APP = ('"""The Space\'s entry point, written by `vit-hub space`: the vit_hub Gradio app (vit_hub/demo), '
             'serving the model that space.json names."""\n\nfrom vit_hub.demo.server import main\n\n'
             'if __name__ == "__main__":\n    main()\n')
# The packages the app imports on its ONNX path, pinned to the versions installed here.
# onnxruntime stands for the installed onnxruntime-gpu: see ONNXRUNTIME_NOTE.
REQUIREMENTS = ("gradio", "onnxruntime", "onnx", "huggingface_hub", "numpy", "scipy", "pillow", "matplotlib",
                "safetensors")  # onnx: vit_hub.export checks each graph before a session opens it
ONNXRUNTIME_NOTE = (
    "# onnxruntime is the CPU build. This project installs onnxruntime-gpu elsewhere and never both\n"
    "# side by side (the CPU build would hide the CUDA provider); a CPU Space gets only this one, which\n"
    "# leaves out the CUDA libraries that onnxruntime-gpu would bring and no CPU Space could load.\n")


@dataclasses.dataclass(frozen=True)
class SpaceSettings:
    """What app.py serves in a Space folder (space.json)."""

    model: str  # a folder inside the Space (MODEL_FOLDER) or a Hub repo id
    revision: str | None  # the repo's commit the Space is pinned to; None for a bundled model
    backend: str = BACKEND


@dataclasses.dataclass(frozen=True)
class WrittenSpace:
    folder: Path  # absolute
    settings: SpaceSettings
    files: list[str]  # paths relative to the folder
    # The Space folder this one replaced, kept beside it when it held a file the new one lacks or
    # holds with other bytes (a person's, see write_folder); None when nothing was replaced or kept.
    backup: Path | None = None


# Writing ------------------------------------------------------------------------------------
def write_space(model: str | Path, out: str | Path, repo_id: str, revision: str | None = None,
                token: str | None = None, check_graph: GraphCheck | None = None) -> WrittenSpace:
    """Write the Space of `model` (a model folder, bundled; or a Hub repo id, pinned to
    `revision`'s commit) into `out`, a new or empty folder or one this function wrote before
    and nobody changed since (MARKER_FILE proves it; it is replaced). `repo_id` is the Space's
    own OWNER/NAME (its title). The Space is written beside `out` and then takes its place, so
    a failure leaves `out` as it was. `check_graph(path, config)` raises for a bundled graph the
    Space's app would refuse at start (the CLI passes vit_hub.export's check: see GraphCheck)."""
    check_repo_id(repo_id, flag="--repo-id")
    out = Path(out)
    _check_out(out, Path(model) if Path(model).is_dir() else None)
    if Path(model).is_dir():
        model_dir = Path(model)
        bundled = _files_to_bundle(model_dir, check_graph)
        settings, model_repo, card = SpaceSettings(MODEL_FOLDER, None), None, ModelDir(model_dir).card
    else:
        bundled = []
        settings = SpaceSettings(str(model), _pinned_commit(str(model), revision, token))
        model_repo, card = str(model), fetch_file(str(model), ModelDir.card, settings.revision, token, required=False)
    texts = {"app.py": SPACE_APP, SETTINGS_FILE: json.dumps(dataclasses.asdict(settings), indent=2) + "\n",
             "requirements.txt": requirements_text(),
             ModelDir.card: readme_text(repo_id, settings, model_repo, _licence(card))}  # a Space's card too
    copies = {**source_files(), **{f"{MODEL_FOLDER}/{path.relative_to(model).as_posix()}": path for path in bundled}}
    return write_folder(out, copies, texts, settings)


def write_folder(out: Path, copies: dict[str, Path], contents: dict[str, str | bytes],
                 settings: SpaceSettings) -> WrittenSpace:
    """Write a Space folder: `copies` ({path inside: file to copy}), `contents` ({path inside:
    text or bytes}) and MARKER_FILE listing them, all beside `out`, then swapped in (a failure
    leaves `out` as it was; a folder replaced is kept as a backup unless the new one holds all
    of it, `space_folder.swap_in`) -> what was written, the paths sorted. What a killed run of
    the same `out` left beside it is finished first (`space_folder.finish_leftovers`)."""
    out = Path(os.path.abspath(out))  # `--out .`: the folder is moved by its name, never as "."
    out.parent.mkdir(parents=True, exist_ok=True)
    finish_leftovers(out)
    files = sorted([*copies, *contents])
    with held_staging(out) as staging:
        final_marker = f"{MARKER_FILE}.final"
        (staging / MARKER_FILE).write_text(intent_marker([*files, final_marker]), encoding="utf-8")
        for name, source in copies.items():
            _copy(source, staging / name)
        for name, content in contents.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
        (staging / final_marker).write_text(_manifest(staging, files), encoding="utf-8")
        os.replace(staging / final_marker, staging / MARKER_FILE)
        backup = swap_in(staging, out)
    return WrittenSpace(out, settings, files, backup)


def _check_out(out: Path, model_dir: Path | None) -> None:
    """`out` must be new, empty, or a Space folder written here before and unchanged since (it
    is replaced); never a link, and never a folder that holds the model."""
    check_name(out)
    if out.is_symlink():
        raise UserError(f"--out: expected a folder, got {out}, a link (give the folder it points to)")
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out: expected a folder, got the file {out}")
    if model_dir is not None and model_dir.resolve().is_relative_to(out.resolve()):
        raise UserError(f"--out: expected a folder apart from the model, got {out}, which holds the model "
                        f"{model_dir}; write the Space elsewhere")
    if out.is_dir() and any(out.iterdir()) and (changed := _not_written_here(out)):
        raise UserError(f"--out: expected a new or empty folder (or a Space folder `vit-hub space` wrote, "
                        f"unchanged), got {out} with {changed}")


def _manifest(folder: Path, files: list[str]) -> str:
    """MARKER_FILE's text: `sha256  path` a line for each file written, sorted."""
    return "".join(f"{sha256(folder / name)}  {name}\n" for name in sorted(files))


def _not_written_here(folder: Path) -> str | None:
    """None when `folder` holds exactly the files its MARKER_FILE lists, each with its hash;
    else what is not so (for a message)."""
    marker = folder / MARKER_FILE
    if marker.is_symlink() or not marker.is_file() or marker.stat().st_size > MAX_MARKER_BYTES:
        return f"no {MARKER_FILE} written by vit-hub space in it"
    listed = {}  # path -> sha256
    for line in marker.read_text(errors="replace").splitlines():
        digest, _, name = line.partition("  ")
        listed[name] = digest
    found = {path.relative_to(folder).as_posix(): path for path in folder.rglob("*")
             if path != marker and (path.is_symlink() or not path.is_dir())}
    others = sorted(set(found) - set(listed)) or sorted(set(listed) - set(found))
    if others:
        return f"{others[0]!r}{f' and {len(others) - 1} more' if len(others) > 1 else ''} added or removed since"
    for name, path in found.items():
        if path.is_symlink() or not path.is_file() or sha256(path) != listed[name]:
            return f"{name!r} changed since it was written"
    return None


def _files_to_bundle(model_dir: Path, check_graph: GraphCheck | None) -> list[Path]:
    """The model files the Space's app reads: config, weights (the "Inside the model" tab), both
    ONNX graphs (classifying, occlusion) and the faithfulness figures when there are some; none
    a link out of the folder, the samples ones the model answers (`check_samples`), and the
    graphs passed through `check_graph`."""
    layout = ExportLayout.for_model(model_dir)
    names = [name for name in (*PUBLISHED_FILES, *APP_EXTRA_FILES) if name != ModelDir.card]  # the Space has its own
    names += [layout.logits.name, layout.attentions.name]
    _refuse_links_out(model_dir, [*names, ModelDir.card], flag="space MODEL")  # the card: its licence is read
    check_model_dir(model_dir, flag="space MODEL")
    for graph in (layout.logits, layout.attentions):
        if not graph.is_file():
            raise FileNotFoundError(f"space: expected {graph.name} in {model_dir}, found none; the Space runs the "
                                    f"ONNX backend, export it first: python -m vit_hub.export --model {model_dir} "
                                    f"--out {model_dir} --output-attentions")
    samples = kept_samples(model_dir)
    check_samples(samples, ViTConfig.from_json(ModelDir(model_dir).config), flag="space")
    paths = [model_dir / name for name in names if (model_dir / name).is_file()] + samples
    size = sum(path.stat().st_size for path in paths)
    if size > MAX_BUNDLE_BYTES:
        raise UserError(f"space: {model_dir} is {size / 2**20:.0f} MB, over the {MAX_BUNDLE_BYTES // 2**20} MB "
                         f"bundled in a Space; push it (vit-hub push --model {model_dir} --repo-id OWNER/NAME "
                         f"--with-onnx) and give the repo id instead, the Space then pulls it when it starts")
    if check_graph is not None:
        config = ViTConfig.from_json(ModelDir(model_dir).config)
        for graph in (layout.logits, layout.attentions):
            check_graph(graph, config)
    return paths


def _pinned_commit(repo_id: str, revision: str | None, token: str | None) -> str:
    """The commit `revision` of the model repo is at now, after checking that it is a vit_hub
    model with both ONNX graphs there."""
    config = fetch_file(repo_id, ModelDir.config, revision, token, flag="space MODEL")
    check_config(config, repo_id)
    with hub_errors(repo_id, revision):
        commit = HfApi(endpoint=hub_endpoint(), token=token).model_info(repo_id, revision=revision or DEFAULT_BRANCH).sha
    layout = ExportLayout.for_model(Path("."))
    for name in (layout.logits.name, layout.attentions.name):
        if not has_file(repo_id, name, commit, token):
            raise FileNotFoundError(f"space: expected {name} in {repo_id}@{revision or DEFAULT_BRANCH}, found none; "
                                    f"the Space runs the ONNX backend: push the model with its graphs, "
                                    f"vit-hub push --model MODEL_DIR --repo-id {repo_id} --with-onnx")
    return commit


def source_files() -> dict[str, Path]:
    """{path in the Space: file here} for the app's sources: the vit_hub package where it runs
    from, vit_hub.export wherever the import system finds it (the checkout's export/ folder, or
    vit_hub/export/ once installed) and the bundled sample digits."""
    export = Path(importlib.util.find_spec("vit_hub.export").origin).parent
    files = {f"vit_hub/{path.relative_to(PACKAGE).as_posix()}": path for path in sorted(PACKAGE.rglob("*.py"))}
    files |= {f"vit_hub/export/{path.name}": path for path in sorted(export.glob("*.py"))}
    files |= {f"vit_hub/{path.relative_to(PACKAGE).as_posix()}": path for path in sorted(BUNDLED_DIGITS.glob("*.png"))}
    return files


def _copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)


def _licence(card: Path | None) -> str:
    """The model card's licence; this project's (MIT) when the card states none."""
    metadata = RepoCard(read_card(card), ignore_metadata_errors=True).data if card is not None and card.is_file() else None
    licence = metadata.get("license") if metadata is not None else None
    return licence if isinstance(licence, str) and licence else "mit"


def requirements_text() -> str:
    """requirements.txt for a CPU Space: what the app's ONNX path imports, at the versions here."""
    pins = []
    for name in REQUIREMENTS:
        installed = "onnxruntime-gpu" if name == "onnxruntime" and _installed("onnxruntime-gpu") else name
        pins.append(f"{name}=={importlib.metadata.version(installed)}")
    return ("# Written by `vit-hub space`: the app's ONNX backend needs no torch.\n" + ONNXRUNTIME_NOTE
            + "\n".join(pins) + "\n")


def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def readme_text(repo_id: str, settings: SpaceSettings, model_repo: str | None, licence: str) -> str:
    """The Space's README: front matter for the Hub (sdk, its version, the model repo linked),
    then what the Space serves and how to call it."""
    front = {
        "title": repo_id.split("/")[1],
        "sdk": "gradio",
        "sdk_version": importlib.metadata.version("gradio"),  # the same gradio as requirements.txt
        "python_version": f"{sys.version_info.major}.{sys.version_info.minor}",
        "app_file": "app.py",
        "license": licence,
        "pinned": False,
        "tags": list(HUB_TAGS),
    }
    if model_repo:
        front["models"] = [model_repo]
    served = (f"the model [{model_repo}](https://huggingface.co/{model_repo}) at commit `{settings.revision}`, "
              f"downloaded when the Space starts" if model_repo else f"the model bundled in `{MODEL_FOLDER}/`")
    return (f"---\n{_yaml(front)}---\n\n# {front['title']}\n\n"
            f"A vit_hub Vision Transformer demo: upload an image to see "
            f"the top classes, a map of the patches that support the prediction, and the attention rollout layer "
            f"by layer. It serves {served}, with ONNX Runtime on the CPU.\n\n"
            f"From Python, `gradio_client` calls `/predict` (labels and the map of the patches as numbers), "
            f"`/predict_labels` (labels only) or `/explain` (labels and the page's four pictures):\n\n"
            f"```python\nfrom gradio_client import Client, handle_file\n\n"
            f"client = Client(\"{repo_id}\")\n"
            f"print(client.predict(handle_file(\"image.png\"), 3, api_name=\"/predict_labels\"))\n```\n\n"
            f"Written by `vit-hub space`; `{SETTINGS_FILE}` names the model `app.py` serves.\n")


def _yaml(mapping: dict) -> str:
    import yaml  # huggingface_hub's dependency

    return yaml.safe_dump(mapping, sort_keys=False)


# Reading (app.py) ----------------------------------------------------------------------------
def read_settings(folder: Path) -> SpaceSettings | None:
    """`folder`/space.json as app.py's defaults, None when there is none. A bundled model's folder
    comes back as a path inside `folder` (one leading out of it is refused)."""
    path = Path(folder) / SETTINGS_FILE
    if not path.is_file():
        return None
    where = f"{SETTINGS_FILE} beside app.py"
    if path.stat().st_size > MAX_SETTINGS_BYTES:
        raise UserError(f"{where}: expected at most {MAX_SETTINGS_BYTES} bytes, got {path.stat().st_size}")
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise UserError(f"{where}: expected JSON, got {error}") from None
    except RecursionError:
        raise UserError(f"{where}: expected JSON nested a few levels deep, got nesting too deep to parse") from None
    fields = {field.name for field in dataclasses.fields(SpaceSettings)}
    if not isinstance(values, dict) or set(values) - fields or not isinstance(values.get("model"), str) \
            or not isinstance(values.get("revision"), (str, type(None))) or values.get("backend") not in ("onnx", "torch"):
        raise UserError(f"{where}: expected {{\"model\": folder or repo id, \"revision\": commit or null, "
                         f"\"backend\": \"onnx\" or \"torch\"}}, got {json.dumps(values)[:200]}")
    settings = SpaceSettings(**values)
    inside = Path(folder) / settings.model
    if not inside.exists():
        return settings  # a repo id
    if not inside.resolve().is_relative_to(Path(folder).resolve()):
        raise UserError(f"{where}: expected the model folder inside the Space, got {settings.model!r}")
    return dataclasses.replace(settings, model=str(inside))


# Uploading ----------------------------------------------------------------------------------
def space_url(repo_id: str) -> str:
    return f"{hub_endpoint()}/spaces/{repo_id}"


def push_space(folder: str | Path, repo_id: str, private: bool | None = None, token: str | None = None,
               sdk: str = "gradio") -> str:
    """Create the Space `repo_id` (a Gradio Space, or with sdk="static" a static one) if needed
    and upload `folder` to it in one commit -> its URL."""
    check_repo_id(repo_id, flag="--repo-id")
    api = HfApi(endpoint=hub_endpoint(), token=_push_token(token), library_name="vit_hub")
    with hub_errors(repo_id):
        api.create_repo(repo_id, repo_type="space", space_sdk=sdk, private=private, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="space",
                          commit_message=f"Demo of {Path(folder).name}, written by vit-hub space")
    return space_url(repo_id)
