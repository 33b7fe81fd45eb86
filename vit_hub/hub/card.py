"""The model card (README.md of a model dir): Hub metadata, then what a reader needs.

Every card written here ends with a seal, an HTML comment holding the SHA-256 of the text
above it. The comment is invisible on the Hub; it lets `vit_hub.hub.repos.push_to_hub` tell a
card vit_hub wrote (safe to regenerate) from one a person has since edited (kept).

Text from the model dir (labels, which are class-folder names, the folder's name, the source
and notes of an imported model, metrics) is untrusted: it goes into the card through `_text`,
escaped for Markdown and HTML on one line, or into code blocks fenced longer than any run of
backticks it holds. A label `<img src=x onerror=alert(1)>` shows as written, and `|` or a
newline cannot break a table.
"""

from __future__ import annotations

import hashlib
import html
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import quote

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from vit_hub.data.hub_datasets import TAR_SUFFIX, hub_reference, is_dataset_folder
from vit_hub.errors import DataError, UserError
from vit_hub.insight.views import NOT_SHOWN
from vit_hub.layout import INSPECT_FIGURES, ModelDir
from vit_hub.model.config import ViTConfig, size_text
from vit_hub.model.fields import read_json
from vit_hub.storage import count_parameters

# How the Hub files every vit_hub repo: its library, its task, and the tags a model repo and a
# Space (vit_hub.hub.space) share. A model repo adds MODEL_TAGS' frameworks.
LIBRARY_NAME = "vit_hub"
PIPELINE_TAG = "image-classification"
HUB_TAGS = (LIBRARY_NAME, "vision-transformer", PIPELINE_TAG)
MODEL_TAGS = (*HUB_TAGS, "pytorch", "onnx")

# Hub dataset ids for the datasets we know by name.
HUB_DATASETS = {"mnist": "ylecun/mnist", "cifar10": "uoft-cs/cifar10", "cifar100": "uoft-cs/cifar100",
                "fashionmnist": "zalando-datasets/fashion_mnist", "svhn": "ufldl-stanford/svhn"}


def card_metadata(config: ViTConfig, metrics: dict[str, Any], model_name: str,
                  source: dict[str, Any] | None = None) -> ModelCardData:
    """Hub metadata. Weights imported or fine-tuned from another model (`source`, source.json)
    carry that model's licence (none stated: no licence claimed) and name it as base_model."""
    settings = metrics.get("settings", {})
    dataset_id, revision = _dataset_id(str(settings.get("data", "")))
    kind, name = (dataset_id, dataset_id) if dataset_id else _local_dataset(str(settings.get("data", "")))
    final = metrics.get("final")
    results = None
    if final:
        results = [EvalResult(
            task_type="image-classification", dataset_type=kind,
            dataset_name=name, dataset_split=final["split"], dataset_revision=revision,
            metric_type="accuracy", metric_value=round(final["accuracy"], 4),
        )]
    return ModelCardData(
        library_name=LIBRARY_NAME, pipeline_tag=PIPELINE_TAG,
        license=source.get("license") if source else "mit",
        base_model=source["source"] if source and source.get("hub") else None,
        tags=list(MODEL_TAGS),
        datasets=[dataset_id] if dataset_id else None, model_name=model_name, eval_results=results,
    )


def _dataset_id(data: str) -> tuple[str | None, str | None]:
    """(the Hub dataset id, its revision) of a run's --data: a hf://datasets/ reference, or a
    dataset known by name (HUB_DATASETS); (None, None) for a folder."""
    try:
        reference = hub_reference(data)
    except DataError:
        reference = None
    if reference:
        return reference
    return HUB_DATASETS.get(data.lower().replace("-", "").replace("_", "")), None


def _local_dataset(data: str) -> tuple[str, str]:
    """(its format, its name) of a --data with no Hub id: a Hugging Face dataset folder's
    builder (parquet, arrow, webdataset) or imagefolder, and the folder's own name (as the run gave it:
    the card says the same where it is pushed from another machine)."""
    name = os.path.basename(os.path.normpath(data)) if data else ""
    kind = "imagefolder"
    if data and is_dataset_folder(Path(data)):
        kind = next((name for name, pattern in (("arrow", "**/*.arrow"), ("webdataset", f"*{TAR_SUFFIX}"))
                     if any(Path(data).glob(pattern))), "parquet")
    return kind, name if name not in ("", ".", "..") else "image folder"


def read_source_record(model_dir: Path) -> dict[str, Any] | None:
    """source.json: where imported or fine-tuned weights came from (vit_hub/hub/import_model.py)."""
    path = ModelDir(model_dir).source
    if not path.is_file():
        return None
    try:
        record = read_json(path)
    except UserError:  # too large or not JSON: the card does without it
        return None
    return record if isinstance(record, dict) and "source" in record else None


MARKDOWN_SPECIALS = re.compile(r"([\\`\[\]|])")  # code, links and images, table cells (escaped with a backslash)
LINE_BREAKS = re.compile(r"[\x00-\x1f\x7f\u2028\u2029]+")


def _text(value: Any) -> str:
    """Untrusted text for a line of Markdown: on one line, HTML shown as text, and nothing that
    starts code, a link, an image or a table cell."""
    one_line = LINE_BREAKS.sub(" ", str(value))
    return MARKDOWN_SPECIALS.sub(r"\\\1", html.escape(one_line, quote=False))


def _code(language: str, *lines: str) -> list[str]:
    """A fenced code block holding `lines` as written: its fence is longer than any run of
    backticks in them, so no line can close it early."""
    longest = max((len(run) for line in lines for run in re.findall(r"`+", line)), default=0)
    fence = "`" * max(3, longest + 1)
    return [f"{fence}{language}", *lines, fence]


def _origin(config: ViTConfig, source: dict[str, Any] | None, folder: Path) -> str:
    """The card's first sentence: how the weights came to be, what the model takes and gives.
    Only what exists is linked: a source on the Hub."""
    image = f"{size_text(config.image_size)} {'grayscale' if config.in_channels == 1 else 'RGB'} input"
    outputs = f"{config.num_classes} classes" if config.num_classes else "no head (its output is the pooled features)"
    vit_hub = "vit_hub"
    if source is None:
        return f"A Vision Transformer image classifier trained from scratch with {vit_hub}: {outputs}, {image}."
    what = _source_words(source, folder)
    licence = (f"Licence: {_text(source['license'])}, as the source states." if source.get("license") else
               "The source states no licence: check its terms before using these weights.")
    if source.get("kind") == "imported":
        return f"A Vision Transformer converted with {vit_hub} from {what}, weights unchanged: {outputs}, {image}. {licence}"
    return f"A Vision Transformer fine-tuned with {vit_hub} from {what}: {outputs}, {image}. {licence}"


def _source_words(source: dict[str, Any], folder: Path) -> str:
    """The weights a model started from, in words: its architecture, named once ("vit_hub ViT",
    not "vit_hub vit_hub ViT"), and where they came from (its own earlier weights when a model
    was trained further in its own folder)."""
    library, architecture = str(source["library"]), str(source["architecture"])
    named = _text(architecture if architecture.startswith(library) else f"{library} {architecture}")
    name = _text(source["source"])
    if source.get("hub"):
        return f"{named} ([{name}](https://huggingface.co/{quote(str(source['source']))}))"
    if Path(str(source["source"])).resolve() == folder.resolve():
        return f"its own earlier weights ({named})"
    return f"{named} ({name})"


def _architecture_table(config: ViTConfig, parameters: int | None) -> str:
    rows = [
        ("input", size_text((*config.image_size, config.in_channels))),
        ("patch", f"{size_text(config.patch_size)} ({config.num_patches} patches + class token)"),
        ("width / depth / heads", f"{config.embed_dim} / {config.depth} / {config.num_heads}"),
        ("MLP ratio", f"{config.mlp_ratio:g}"),
        ("positions / pooling", f"{config.pos_embedding} / {config.pooling}"),
        ("patch embedding", config.patch_embedding + (" + locality attention" if config.locality_attention else "")),
        ("regularisation", f"dropout {config.dropout:g}, drop path {config.drop_path:g}"),
        ("normalisation", _normalisation(config)),
        ("classes", f"{config.num_classes}: {', '.join(map(_text, config.labels[:12]))}{' ...' if config.num_classes > 12 else ''}"
                    if config.num_classes else "none: no head, the output is the pooled features"),
    ]
    if parameters:
        rows.insert(0, ("parameters", f"{parameters / 1e6:.2f} M"))
    return "| | |\n|---|---|\n" + "\n".join(f"| {name} | {value} |" for name, value in rows)


def _canonicalisation(config: ViTConfig) -> str:
    if config.canonicalize == "digit":
        return ("bring the digit into MNIST's frame (ink polarity read from the image, uneven light "
                "removed, cropped, scaled to 20/28 and centred by mass: `vit_hub/processing/canonical.py`), ")
    return ""


def _normalisation(config: ViTConfig) -> str:
    if config.pixel_norm == "image":
        return "each image's own mean and std per channel"
    return f"mean {config.mean}, std {config.std}"


def _metrics_section(metrics: dict[str, Any]) -> str:
    lines = []
    final = metrics.get("final")
    evaluation = metrics.get("evaluation")
    if evaluation:  # validation and test side by side
        lines += ["| split | accuracy | loss | images |", "|---|---|---|---|"]
        lines += [f"| {_text(name)} | {split['accuracy']:.4f} | {split['loss']:.4f} | {split['n']} |"
                  for name, split in evaluation.items()]
        lines.append("")
    elif final:
        lines.append(f"- **{_text(final['split'])} accuracy: {final['accuracy']:.4f}** "
                     f"(loss {final['loss']:.4f}, {final['n']} images)")
    if metrics.get("warning"):
        lines.append(f"- **Warning: {_text(metrics['warning'])}.**")
    if metrics.get("best_val_accuracy") is not None and metrics.get("history"):
        lines.append(f"- best validation accuracy: {metrics['best_val_accuracy']:.4f} "
                     f"after {len(metrics['history'])} of {metrics.get('epochs')} epochs")
        last = metrics["history"][-1]
        lines.append(f"- throughput: {last['images_per_second']:.0f} training images/s")
    hardware = metrics.get("hardware")
    if hardware:
        lines.append(f"- trained on: {_text(hardware['device'])} x {_text(hardware['processes'])} process(es), "
                     f"{_text(hardware['precision'])}, torch {_text(hardware['torch'])}")
    return "\n".join(lines) or "No metrics recorded."


def render_model_card(model_dir: Path, repo_id: str | None = None, onnx: bool | None = None) -> ModelCard:
    """The card for `model_dir`; snippets load from `repo_id` when given, else from the folder.

    `onnx` says whether model.onnx sits beside the weights (default: whether the folder has it).
    """
    files = ModelDir(model_dir)
    if onnx is None:
        onnx = files.export.logits.is_file()
    config = ViTConfig.from_json(files.config)
    metrics = read_json(files.metrics) if files.metrics.is_file() else {}
    name = repo_id or files.folder.name
    source = read_source_record(files.folder)
    sections = [
        "---", card_metadata(config, metrics, name, source).to_yaml(), "---", "",
        f"# {_text(name)}", "", _origin(config, source, files.folder), "",
        "## Architecture", "", _architecture_table(config, count_parameters(files.weights)), "",
        *_training_section(metrics, source),
        "## Metrics", "", _metrics_section(metrics), *_calibration_line(config), "",
        *_training_figures(files),
        *_inside_section(files),
        *_usage_section(config, repo_id or str(files.folder), repo_id, onnx),
    ]
    return ModelCard("\n".join(sections))


def _training_section(metrics: dict[str, Any], source: dict[str, Any] | None) -> list[str]:
    """How the weights were made: the command that converted them, or the one that trained them."""
    if source and source.get("kind") == "imported":
        return ["## Conversion", "", "Not trained here; converted with:", "",
                *_code("bash", source.get("command") or "(not recorded)"), "",
                *[f"- {_text(note)}" for note in source["notes"]], ""]
    command = metrics.get("settings", {}).get("command") or "(not recorded)"
    return ["## Training", "", *_code("bash", command), ""]


def _calibration_line(config: ViTConfig) -> list[str]:
    """How the probabilities are calibrated, when a temperature was fitted."""
    if config.temperature == 1.0:
        return []
    return [f"- probabilities: softmax(logits / {config.temperature:g}), the temperature fitted on the validation "
            f"split (`vit_hub.train.calibration`: training's label smoothing leaves raw probabilities less sure than the "
            f"model is right); rankings and accuracy are unchanged"]


def _training_figures(files: ModelDir) -> list[str]:
    """The curves and the confusion matrix that training drew, those of them the folder has."""
    shown = [("training curves", ModelDir.curves), ("confusion matrix", ModelDir.confusion_matrix)]
    return [line for alt, name in shown if (files.folder / name).is_file() for line in (f"![{alt}]({name})", "")]


def _usage_section(config: ViTConfig, reference: str, repo_id: str | None, onnx: bool) -> list[str]:
    """How to run the model: Python, the command line, ONNX Runtime, the app, and its preprocessing."""
    return [
        "## Usage", "",
        "Python (PyTorch):", "",
        *_code("python", "from vit_hub import VisionTransformer, predict_images",
               f'model = VisionTransformer.from_pretrained("{reference}")',
               'print(predict_images(model, ["image.png"], top_k=3))'), "",
        "Command line:", "", *_code("bash", f"vit-hub predict --model {reference} image.png"), "",
        *_onnx_usage(reference, repo_id, onnx),
        "Gradio app with attention-rollout overlays:", "", *_code("bash", f"python app.py --model {reference}"), "",
        f"Preprocessing (in `{ModelDir.config}`): {_canonicalisation(config)}convert to "
        f"{'L' if config.in_channels == 1 else 'RGB'}, "
        f"resize to {size_text(config.image_size)} ({config.interpolation}), scale to [0, 1], "
        f"normalise with {_normalisation(config)}.", "",
    ]


def _inside_section(files: ModelDir) -> list[str]:
    """The views training drew of what the model learned (`vit-hub inspect`), each with its
    one-sentence reading from inspect.json; nothing when the model dir has none. A view's
    reading is keyed by its name, the stem of its figure's file (patch_filters.png)."""
    shown = [name for name in INSPECT_FIGURES if (files.folder / name).is_file()]
    if not files.inspect_report.is_file() or not shown:
        return []
    try:
        readings = read_json(files.inspect_report).get("readings")
    except (UserError, AttributeError):  # not JSON, or not an object: the figures still show
        readings = None
    readings = readings if isinstance(readings, dict) else {}
    lines = ["## Inside the model", "",
             "The views of the ViT paper (Dosovitskiy et al. 2021, Figure 7): the patch projection's filters, "
             "the similarity of the position embeddings, and how far each head looks "
             f"(`vit-hub inspect`; numbers in `{ModelDir.inspect_report}`).", ""]
    for figure in shown:
        view = Path(figure).stem
        reading = _text(readings.get(view, ""))
        if reading.startswith(NOT_SHOWN):  # the view could not be computed: its reason, no picture
            lines += [f"{view.replace('_', ' ').capitalize()}: {reading}", ""]
        else:
            lines += [f"![{view.replace('_', ' ')}]({figure})", "", reading, ""]
    return lines


def _onnx_usage(reference: str, repo_id: str | None, onnx: bool) -> list[str]:
    """ONNX Runtime snippet: files from the repo (or the folder), exported first if absent."""
    local = ModelDir(Path(reference))
    graph, config = local.export.logits.name, ModelDir.config  # file names in a repo
    onnx_path = graph if repo_id else str(local.export.logits)
    lines = [f"ONNX Runtime, no torch needed (`{graph}` + `{config}`):", ""]
    if not onnx:
        lines += [*_code("bash", f"python -m vit_hub.export --model {reference} --out {onnx_path}"), ""]
    if repo_id:
        paths = ["from huggingface_hub import hf_hub_download",
                 f'config_path = hf_hub_download("{repo_id}", "{config}")',
                 f'onnx_path = hf_hub_download("{repo_id}", "{graph}")' if onnx else f'onnx_path = "{graph}"']
    else:
        paths = [f'onnx_path, config_path = "{onnx_path}", "{local.config}"']
    pipeline = local.export.pipeline.name
    return lines + [*_code("python", *paths, "from vit_hub.export import OnnxClassifier",
                           "classifier = OnnxClassifier(onnx_path, config_path)",
                           'print(classifier.predict("image.png", top_k=3))'), "",
                    f"From any language: `{pipeline}` takes an image's decoded pixels (uint8 [height, width, "
                    f"channels]) and returns the probabilities in `{config}`'s label order, with the whole "
                    "preprocessing described below inside the graph (vit_hub's docs/export.md, \"From another language\"). "
                    f"`{local.export.pipeline_map.name}` (exported with `--output-attentions`) also returns `map`, "
                    "the attention-rollout map over the patch grid in [0, 1], and `model_input`, the image the "
                    f"model saw; `{local.export.preprocess.name}` is the preprocessing alone, for a server that "
                    "batches the network on a GPU.", ""]


def render_card_text(model_dir: Path, repo_id: str | None = None, onnx: bool | None = None) -> str:
    """The card as README.md text, sealed."""
    return seal_card(str(render_model_card(model_dir, repo_id, onnx)))


def write_model_card(model_dir: Path, repo_id: str | None = None) -> Path:
    """The sealed card written as the model dir's README.md; returns its path."""
    path = ModelDir(model_dir).card
    path.write_text(render_card_text(model_dir, repo_id), encoding="utf-8")
    return path


SEAL_PREFIX = "<!-- vit_hub card sha256:"


def _digest(body: str) -> str:
    return hashlib.sha256(body.replace("\r\n", "\n").encode("utf-8")).hexdigest()


def seal_card(text: str) -> str:
    """`text` followed by a hidden line holding its checksum."""
    body = text.rstrip() + "\n\n"
    return f"{body}{SEAL_PREFIX}{_digest(body)} -->\n"


def is_generated_card(text: str) -> bool:
    """True when `text` is a card vit_hub sealed and nobody has changed since."""
    body, found, seal = text.rpartition(SEAL_PREFIX)
    return bool(found) and seal.rstrip() == f"{_digest(body)} -->"
