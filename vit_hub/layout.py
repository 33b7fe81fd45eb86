"""Every file a model dir can hold, and the names inside its ONNX graphs. Torch-free, and the
one place these names are written: training and import write this layout, `python -m vit_hub.export`
adds its graphs, ONNX Runtime, the app and the Hub read it, a push uploads it.

A model dir (`models/vit-mnist`):

    config.json                the architecture, preprocessing and labels (vit_hub.model.config)
    model.safetensors          the weights
    README.md                  the model card (vit_hub.hub.card)
    metrics.json               per-epoch history and test scores (training)
    curves.png                 loss and accuracy per epoch (training)
    confusion_matrix.png       test predictions against labels (training)
    inspect.json               what the model learned, measured (`vit-hub inspect`)
    patch_filters.png          ...and drawn: the patch embedding's filters,
    position_similarity.png      how alike the position embeddings are,
    attention_distance.png       how far each head looks
    source.json                where imported or fine-tuned weights came from (vit_hub.hub.import_model)
    faithfulness.json          how well each explanation tracks the model (bench/faithfulness.py)
    samples/                   a few validation images, the app's examples (vit_hub.data.samples)
    checkpoint.safetensors     the latest epoch's full training state (kept local, never pushed)

`ModelDir.config` is the name ("config.json"), `ModelDir(folder).config` its path.

Its ONNX files (`--out models/vit-mnist/model.onnx`, or just the folder `models/vit-mnist`):

    model.onnx                 logits only: what a classifier runs
    model_attentions.onnx      logits and attentions (with --output-attentions), for rollout
    pipeline.onnx              decoded image in, probabilities out: the preprocessing, the network
                                 and a softmax in one graph, for apps in any language
    pipeline_map.onnx          the same, and the app's rollout map over the image the model saw (with
                                 --output-attentions), for pages that draw where the model looked
    pipeline_explain.onnx      the same, with the map the app's page opens with (gradients traced
                                 into forward operators) and rollout beside it (with
                                 --output-attentions)
    preprocess.onnx            decoded image in, pixel_values [1, C, H, W] out: pipeline.onnx's
                                 preprocessing alone, for the CPU provider beside a batched
                                 network on the GPU (a server's route)
    model_int8.onnx            int8 dynamic quantization of model.onnx (with --quantize int8)
    model_fp16.onnx            float16 copies of the graphs above, float32 in and out, for
    model_attentions_fp16.onnx   the CUDA provider (with --precision fp16)
    pipeline_fp16.onnx
    model_export_report.json   verification, parity, quantization accuracy and speed
    model_export_report.failed.json  instead, where a check failed: nothing else was installed
    config.json                preprocessing and labels (shared by every graph in the folder)

Every graph carries the sha256 of the model.safetensors it was exported from; ONNX Runtime
refuses graphs whose weights differ from the model.safetensors in the same folder.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

# The graph's input and outputs, by name.
GRAPH_INPUT = "pixel_values"  # [batch, channels, height, width], normalized as config.json says
GRAPH_LOGITS = "logits"  # [batch, classes]
GRAPH_ATTENTIONS = "attentions"  # [depth, batch, heads, tokens, tokens]
PIPELINE_INPUT = "image"  # pipeline.onnx: uint8 [height, width, channels], as an image decoder gives it
PIPELINE_OUTPUT = "probabilities"  # pipeline.onnx: float32 [classes]
PIPELINE_MAP = "map"  # pipeline_map.onnx also: float32 [grid_h, grid_w] in [0, 1], attention rollout
PIPELINE_ROLLOUT = "rollout"  # pipeline_explain.onnx: float32 [grid_h, grid_w], attention rollout (its map: the page's)
PIPELINE_MODEL_INPUT = "model_input"  # ...uint8 [height, width, channels]: the image the model saw
PIPELINE_MAP_COLOURS = "map_colours"  # ...uint8 [256, 3]: the app's colour map, a colour per round(255 * map)
MAP_METHOD_KEY = "vit_hub.map_method"  # pipeline_explain.onnx's metadata: the method its map is (attribution.METHODS)
MAP_LABEL_KEY = "vit_hub.map_label"  # ...that method as the page labels it

DEFAULT_STEM = "model"
PIPELINE_STEM = "pipeline"
PREPROCESS_STEM = "preprocess"
MAP_SUFFIX = "_map"
EXPLAIN_SUFFIX = "_explain"
ATTENTIONS_SUFFIX = "_attentions"
INT8_SUFFIX = "_int8"
FP16_SUFFIX = "_fp16"


class _File:
    """One file of a model dir: its name on the class, its path on an instance."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, model_dir: "ModelDir | None", owner: type) -> "str | Path":
        return self.name if model_dir is None else model_dir.folder / self.name


@dataclasses.dataclass(frozen=True)
class ModelDir:
    folder: Path

    config = _File("config.json")
    weights = _File("model.safetensors")
    card = _File("README.md")
    metrics = _File("metrics.json")
    curves = _File("curves.png")
    confusion_matrix = _File("confusion_matrix.png")
    inspect_report = _File("inspect.json")
    patch_filters = _File("patch_filters.png")
    position_similarity = _File("position_similarity.png")
    attention_distance = _File("attention_distance.png")
    source = _File("source.json")
    faithfulness = _File("faithfulness.json")
    checkpoint = _File("checkpoint.safetensors")
    samples = _File("samples")

    def __post_init__(self):
        object.__setattr__(self, "folder", Path(self.folder))

    @property
    def export(self) -> "ExportLayout":
        """The folder's own ONNX files (model.onnx and its siblings)."""
        return ExportLayout(self.folder, DEFAULT_STEM)


# What `vit-hub inspect` draws, and what a push uploads (checkpoints and other files stay local;
# ONNX files go up with --with-onnx, see ExportLayout.onnx_files).
INSPECT_FIGURES = (ModelDir.patch_filters, ModelDir.position_similarity, ModelDir.attention_distance)
PUBLISHED_FILES = (ModelDir.config, ModelDir.weights, ModelDir.card, ModelDir.metrics, ModelDir.curves,
                   ModelDir.confusion_matrix, ModelDir.inspect_report, *INSPECT_FIGURES, ModelDir.source)


@dataclasses.dataclass(frozen=True)
class ExportLayout:
    folder: Path
    stem: str

    @classmethod
    def for_output(cls, out: str | Path) -> "ExportLayout":
        """`--out`: a path ending in .onnx names the logits graph; anything else is a folder."""
        out = Path(out)
        if out.is_symlink() and not out.exists():
            raise FileNotFoundError(f"--out: expected a folder or a path ending in .onnx, got {out}, a link to nothing")
        if out.suffix == ".onnx":
            return cls(out.parent, out.stem)
        if out.exists() and not out.is_dir():
            raise NotADirectoryError(f"--out: expected a folder or a path ending in .onnx, got the file {out}")
        return cls(out, DEFAULT_STEM)

    @classmethod
    def for_model(cls, model_path: str | Path) -> "ExportLayout":
        """The layout a graph belongs to: the folder holding it (`model.onnx` inside a folder)."""
        model_path = Path(model_path)
        if model_path.is_dir():
            return cls(model_path, DEFAULT_STEM)
        return cls(model_path.parent, model_path.stem)

    @property
    def logits(self) -> Path:
        return self.folder / f"{self.stem}.onnx"

    @property
    def attentions(self) -> Path:
        return self.folder / f"{self.stem}{ATTENTIONS_SUFFIX}.onnx"

    @property
    def pipeline(self) -> Path:
        """The whole-pipeline graph: pipeline.onnx beside model.onnx (`<stem>_pipeline.onnx` for another stem)."""
        name = PIPELINE_STEM if self.stem == DEFAULT_STEM else f"{self.stem}_{PIPELINE_STEM}"
        return self.folder / f"{name}.onnx"

    @property
    def preprocess(self) -> Path:
        """The preprocessing graph: preprocess.onnx beside model.onnx (`<stem>_preprocess.onnx` for another stem)."""
        name = PREPROCESS_STEM if self.stem == DEFAULT_STEM else f"{self.stem}_{PREPROCESS_STEM}"
        return self.folder / f"{name}.onnx"

    @property
    def pipeline_map(self) -> Path:
        """The pipeline graph that also gives the rollout map: pipeline_map.onnx beside pipeline.onnx."""
        return self.pipeline.with_name(f"{self.pipeline.stem}{MAP_SUFFIX}.onnx")

    @property
    def pipeline_explain(self) -> Path:
        """The pipeline graph that also gives the page's opening map: pipeline_explain.onnx beside pipeline.onnx."""
        return self.pipeline.with_name(f"{self.pipeline.stem}{EXPLAIN_SUFFIX}.onnx")

    @property
    def int8(self) -> Path:
        return self.folder / f"{self.stem}{INT8_SUFFIX}.onnx"

    @staticmethod
    def in_precision(graph: Path, precision: str) -> Path:
        """The float16 copy of a graph ("fp16": model_fp16.onnx beside model.onnx), or the
        graph itself ("fp32")."""
        return graph.with_name(f"{graph.stem}{FP16_SUFFIX}.onnx") if precision == "fp16" else graph

    @property
    def report(self) -> Path:
        return self.folder / f"{self.stem}_export_report.json"

    @property
    def failed_report(self) -> Path:
        """A failed export's report: its graphs were not installed."""
        return self.folder / f"{self.stem}_export_report.failed.json"

    @property
    def config(self) -> Path:
        return self.folder / ModelDir.config

    @property
    def weights(self) -> Path:
        """The weights the graphs were exported from, when the folder is the model dir itself."""
        return self.folder / ModelDir.weights

    @property
    def onnx_files(self) -> tuple[Path, ...]:
        """What a model dir ships of an export: the logits graph, the attentions graph (the
        app's ONNX backend draws rollout from it), the pipeline graph, their float16 copies, the
        pipeline graphs with the rollout map and with the page's opening map, the preprocessing
        graph and the report."""
        graphs = (self.logits, self.attentions, self.pipeline)
        return (*graphs, *(self.in_precision(graph, "fp16") for graph in graphs), self.pipeline_map,
                self.pipeline_explain, self.preprocess, self.report)
