"""The model behind the page: PyTorch or ONNX Runtime, driven through one `Predictor` protocol.

The torch backend computes every explanation method; the ONNX backend runs the model's
attentions graph without torch and offers the methods that need no gradients.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from vit_hub.errors import UserError
from vit_hub.explain.attribution import METHODS, Forward, check_method
from vit_hub.layout import ModelDir
from vit_hub.model.config import ViTConfig
from vit_hub.processing.postprocess import softmax

BACKENDS = ("torch", "onnx")


class Predictor(Protocol):
    """A backend the UI can drive: the model's config and one forward pass."""

    config: ViTConfig
    description: str  # shown on the page, e.g. "torch (CPU)"
    methods: tuple[str, ...]  # the explanation methods it computes (names in vit_hub.explain.attribution.METHODS)
    model_dir: Path | None  # where the model's files are, when they are in a local folder

    def predict(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """float32 [B, C, H, W] -> (probabilities [B, classes], attentions [depth, B, heads, T, T])."""

    def explain(self, pixels: np.ndarray, method: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """float32 [B, C, H, W] -> (probabilities, attentions, the method's maps [B, grid_h, grid_w])."""

    def weights(self) -> dict[str, np.ndarray] | None:
        """The model's weights as arrays (for the "Inside the model" tab), None when it has none."""


class TorchPredictor:
    """The PyTorch model, on the CPU.

    threads: torch intra-op threads for the whole process. One per request is best for a
    small model: concurrent requests already keep the cores busy, and several threads
    per forward pass spin against each other (measured 10x slower on a loaded 2-core
    machine; see BENCHMARKS.md).
    """

    def __init__(self, model: Any, threads: int | None = 1):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.model = model.eval()
        self.config = model.config
        self.description = "torch (CPU)"
        self.methods = tuple(METHODS)
        self.model_dir: Path | None = None

    @classmethod
    def load(cls, reference: str | Path, threads: int | None = 1, revision: str | None = None) -> "TorchPredictor":
        from vit_hub.hub.pretrained import load_model

        predictor = cls(load_model(reference, revision), threads)
        predictor.model_dir = Path(reference) if Path(reference).is_dir() else None
        return predictor

    def predict(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        import torch

        with torch.inference_mode():
            logits, attentions = self.model(torch.from_numpy(pixels), output_attentions=True)
        return softmax(logits.numpy(), self.config.temperature), torch.stack(attentions).numpy()

    def explain(self, pixels: np.ndarray, method: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        from vit_hub.explain.run import explain

        logits, attentions, maps = explain(self.model, pixels, method)
        return softmax(logits, self.config.temperature), attentions, maps

    def weights(self) -> dict[str, np.ndarray]:
        from vit_hub.insight.views import torch_weights

        return torch_weights(self.model)


class OnnxPredictor:
    """ONNX Runtime on the model's `model_attentions.onnx` graph (torch-free at run time)."""

    def __init__(self, classifier: Any):
        if not classifier.can_output_attentions:
            raise UserError(f"{classifier.model_path} has no attentions graph; export with --output-attentions")
        self.classifier = classifier
        self.config = classifier.config
        self.methods = tuple(name for name, method in METHODS.items() if method.runs_on_onnx)
        self.model_dir = classifier.model_dir
        self.description = f"ONNX Runtime ({classifier.providers[0]}, {classifier.precision})"
        # One run now: a graph that cannot load fails at start, not at a user's first request.
        self.predict(np.zeros((1, self.config.in_channels, *self.config.image_size), dtype=np.float32))

    @classmethod
    def load(cls, reference: str | Path, threads: int | None = 1, revision: str | None = None) -> "OnnxPredictor":
        """A model dir or Hub repo id (at `revision`); without model_attentions.onnx there, export
        to a temp dir first. threads: onnxruntime intra-op threads per session (one, as for torch)."""
        from vit_hub.export import open_exporting  # the runtime never exports: this backend asks for it

        return cls(open_exporting(reference, output_attentions=True, export_dir=_export_dir,
                                  threads=threads, revision=revision))

    def predict(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        logits, attentions = self.classifier.run(pixels, output_attentions=True)
        return softmax(logits, self.config.temperature), attentions

    def explain(self, pixels: np.ndarray, method: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The maps that need no gradients, from one run of the graph (occlusion runs it again)."""
        chosen = check_method(method)
        if not chosen.runs_on_onnx:
            raise UserError(f"{METHODS[method].label} needs gradients, which the ONNX backend does not compute: "
                            f"start the app with --backend torch, or choose one of "
                            f"{', '.join(METHODS[name].label for name in self.methods)}")
        logits, attentions = self.classifier.run(pixels, output_attentions=True)
        maps = chosen.compute(Forward(pixels, logits, attentions, self.classifier.run), logits.argmax(-1), self.config)
        return softmax(logits, self.config.temperature), attentions, maps

    def weights(self) -> dict[str, np.ndarray] | None:
        """model.safetensors read as arrays (no torch) when the model dir has it; else None."""
        from vit_hub.insight.inspect import read_weights

        folder = self.classifier.model_dir
        return read_weights(folder) if ModelDir(folder).weights.is_file() else None


def _export_dir(model_dir: Path) -> Path:
    """A temporary folder for the ONNX export of a model that ships none, removed at exit."""
    out = Path(tempfile.mkdtemp(prefix="vit_hub_onnx_"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)  # also on SIGTERM: see server.main()
    print(f"app.py: {model_dir} has no model_attentions.onnx; exporting to {out} (torch is loaded for this; "
          f"`python -m vit_hub.export --output-attentions` once makes later starts torch-free) ...", flush=True)
    return out


def load_predictor(reference: str | Path, backend: str, revision: str | None = None) -> Predictor:
    """revision: of a Hub repo id (branch, tag or commit; default main)."""
    if backend == "torch":
        return TorchPredictor.load(reference, revision=revision)
    if backend == "onnx":
        return OnnxPredictor.load(reference, revision=revision)
    raise UserError(f"--backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
