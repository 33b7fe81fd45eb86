"""Where the ONNX files of a model live. Torch-free, and the one place their names are written:
`python -m export` writes this layout, ONNX Runtime and the app read it, a push uploads it.

`--out models/vit-mnist/model.onnx` (or just the folder `models/vit-mnist`) gives

    model.onnx                 logits only: what a classifier runs
    model_attentions.onnx      logits and attentions (with --output-attentions), for rollout
    model_int8.onnx            int8 dynamic quantization of model.onnx (with --quantize int8)
    model_fp16.onnx            float16 copies of the graphs above, float32 in and out, for
    model_attentions_fp16.onnx   the CUDA provider (with --precision fp16)
    model_export_report.json   verification, parity, quantization accuracy and speed
    config.json                preprocessing and labels (shared by every graph in the folder)

Every graph carries the sha256 of the model.safetensors it was exported from; ONNX Runtime
refuses graphs whose weights differ from the model.safetensors in the same folder.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

DEFAULT_STEM = "model"
ATTENTIONS_SUFFIX = "_attentions"
INT8_SUFFIX = "_int8"
FP16_SUFFIX = "_fp16"
WEIGHTS = "model.safetensors"


@dataclasses.dataclass(frozen=True)
class ExportLayout:
    folder: Path
    stem: str

    @classmethod
    def for_output(cls, out: str | Path) -> "ExportLayout":
        """`--out`: a path ending in .onnx names the logits graph; anything else is a folder."""
        out = Path(out)
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
    def config(self) -> Path:
        return self.folder / "config.json"

    @property
    def weights(self) -> Path:
        """The weights the graphs were exported from, when the folder is the model dir itself."""
        return self.folder / WEIGHTS

    @property
    def onnx_files(self) -> tuple[Path, ...]:
        """What a model dir ships of an export: the logits graph, the attentions graph (the
        app's ONNX backend draws rollout from it), their float16 copies and the report."""
        graphs = (self.logits, self.attentions)
        return (*graphs, *(self.in_precision(graph, "fp16") for graph in graphs), self.report)
