"""Run an exported vit_hub model with ONNX Runtime. This module never imports torch, nor the
exporter: a model without its graphs is exported by the caller (`on_demand.ensure_graphs`).

    classifier = OnnxClassifier("models/vit-mnist/model.onnx")   # config.json beside it
    classifier = OnnxClassifier.from_model("you/vit-mnist")     # a model dir or a Hub repo id
    classifier.providers                  # e.g. ['CPUExecutionProvider']
    classifier.predict("digit.png", top_k=3)                   # [(label, probability), ...]
    logits = classifier.run(pixel_values)                      # [B, classes]
    logits, attentions = classifier.run(pixel_values, output_attentions=True)
    # attentions [depth, B, heads, T, T] come from model_attentions.onnx (export --output-attentions)

Which providers, precision and CUDA options a session opens with is `session.py`'s job; with
a provider asked for by name, `strict=True` raises instead of falling back. On CUDA the
input is bound once and the outputs are allocated on the device (IO binding).

Graphs are untrusted input: each is checked (`graph_check.check_graph`) before a session is
created, and must carry the sha256 of the weights it was exported from; a graph exported
from other weights than the model.safetensors beside it, or a logits and attentions graph
from different weights, is refused. A file that is not such a graph, or that onnxruntime
cannot load or run, raises OnnxModelError naming it, in one line.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnxruntime as ort

from vit_hub.errors import UserError
from vit_hub.hub.repos import resolve_model_dir
from vit_hub.layout import GRAPH_ATTENTIONS, GRAPH_INPUT, GRAPH_LOGITS, ExportLayout
from vit_hub.model.config import ViTConfig, size_text
from vit_hub.processing.postprocess import softmax
from vit_hub.processing.postprocess import top_k as rank_top_k
from vit_hub.processing.preprocess import ImageInput, preprocess_batch

from .graph_check import OnnxModelError, tied_weights, weights_sha256
from .session import (CUDA, ORT_ERRORS, QUIET_RUN, choose_precision, create_session, cuda_can_start, ort_detail,
                      provider_name, report_fallback, requested_providers)

EXPORT_COMMAND = "python -m vit_hub.export --model MODEL_DIR --out"  # completed by the folder or graph


class OnnxClassifier:
    """An exported model (`model.onnx` + `config.json`) behind a small classification API.

    Args:
        model_path: the .onnx file, or a folder holding model.onnx.
        config_path: the model's config.json; default: config.json beside the model.
        providers: "auto", "cpu", "cuda" or an onnxruntime provider list (see session.py).
        strict: raise ProviderFallbackError instead of falling back from a provider asked
            for by name ("cuda" or a list); "auto" takes whatever starts.
        exact: on CUDA, full float32 instead of TF32 (`use_tf32=0`), for parity with torch.
        precision: "fp32", "fp16" (the float16 copies, `export --precision fp16`), or "auto":
            fp16 when CUDA runs the model and the copy exists, else fp32.
        threads: onnxruntime intra-op threads (default: onnxruntime's choice, one per core).
        io_binding: bind inputs/outputs to the device; default: on when CUDA runs the model.
        spinning: False makes onnxruntime's idle threads sleep between runs instead of spinning
            on a core (`session.NO_SPINNING`): for a server whose other threads need the cores.
    """

    def __init__(self, model_path: str | Path, config_path: str | Path | None = None,
                 providers: str | Sequence[Any] = "auto", strict: bool = False,
                 threads: int | None = None, io_binding: bool | None = None, exact: bool = False,
                 precision: str = "auto", spinning: bool = True):
        self.layout = ExportLayout.for_model(model_path)
        self.model_path = self.layout.logits
        self.model_dir = self.layout.folder  # from_model: the model's own folder, which holds its weights
        if not self.model_path.is_file():
            raise FileNotFoundError(f"expected an ONNX model at {self.model_path}, found nothing "
                                    f"(export one with: {EXPORT_COMMAND} {self.model_path})")
        self.config = ViTConfig.from_json(config_path or self.layout.config)
        wanted, explicit = requested_providers(providers, exact)
        self._threads, self._spinning = threads, spinning
        self.precision, self.session = self._open(wanted, precision)
        report_fallback(wanted, self.providers[0], explicit, strict)
        # What later sessions (the attentions graph) ask for: what this one got, after a fallback.
        self._providers = wanted if provider_name(wanted[0]) == self.providers[0] else self.providers
        self._device = "cuda" if self.providers[0] == CUDA else "cpu"
        self._io_binding = self._device == "cuda" if io_binding is None else io_binding
        self.weights_sha256 = self._check_weights(self.session, self._graph(self.model_path))
        self._attentions: ort.InferenceSession | None = None
        self._attentions_lock = threading.Lock()

    def _open(self, wanted: list[Any], precision: str) -> tuple[str, ort.InferenceSession]:
        """(precision, session) of the logits graph: with "auto", the float16 copy when CUDA is to
        run it, and the float32 graph again when CUDA did not start after all."""
        fp16_exported = self.layout.in_precision(self.model_path, "fp16").is_file()
        chosen = choose_precision(precision, wanted, cuda_can_start(), fp16_exported)
        session = create_session(self._graph(self.model_path, chosen), wanted, self._threads, self.config,
                                 self._spinning)
        if precision == "auto" and chosen == "fp16" and session.get_providers()[0] != CUDA:  # CUDA did not start
            return "fp32", create_session(self.model_path, wanted, self._threads, self.config, self._spinning)
        return chosen, session

    @classmethod
    def from_model(cls, reference: str | Path, *, output_attentions: bool = False, revision: str | None = None,
                   token: str | None = None, graphs_dir: str | Path | None = None,
                   **options: Any) -> "OnnxClassifier":
        """A model dir or Hub repo id, resolved as `vit_hub.load_model` resolves it (one-line
        HubErrors, HF_ENDPOINT, the config checked first), with the ONNX graphs it ships, or
        those in `graphs_dir` when they were exported elsewhere (`on_demand.ensure_graphs`).

        The graph needed (the attentions graph with `output_attentions`) must be there: a
        FileNotFoundError names the export command. `options` go to the constructor.
        """
        model_dir = resolve_model_dir(reference, revision, token, with_onnx=True)
        folder = Path(graphs_dir) if graphs_dir is not None else model_dir
        layout = ExportLayout.for_model(folder)
        graph = layout.attentions if output_attentions else layout.logits
        if not graph.is_file():
            raise FileNotFoundError(f"expected {graph.name} in {folder}, found none; export it with: "
                                    f"python -m vit_hub.export --model {reference} --out {folder} --output-attentions")
        classifier = cls(folder, **options)
        classifier.model_dir = model_dir
        return classifier

    def _graph(self, graph: Path, precision: str | None = None) -> Path:
        """`graph` in this classifier's precision; a missing float16 copy names the export command."""
        path = self.layout.in_precision(graph, precision or self.precision)
        if not path.is_file():
            raise FileNotFoundError(f"precision fp16: expected {path.name} beside {graph.name}, found none; export "
                                    f"it with: {EXPORT_COMMAND} {self.model_path} --precision fp16")
        return path

    @property
    def providers(self) -> list[str]:
        """The execution providers the session runs on, in priority order (`session.get_providers()`)."""
        return self.session.get_providers()

    # Graphs ------------------------------------------------------------------------
    def _check_weights(self, session: ort.InferenceSession, path: Path, paired_with: str | None = None) -> str:
        """The sha256 of the weights the graph was exported from (its metadata); refused when it
        has none, when it is not `paired_with` (the logits graph's), or when the model.safetensors
        beside it has another."""
        found = tied_weights(session.get_modelmeta().custom_metadata_map)
        fix = f"export again: {EXPORT_COMMAND} {self.layout.folder}"
        if found is None:
            raise OnnxModelError(f"{path}: expected the sha256 of the weights it was exported from in its metadata, "
                                 f"found none; {fix}")
        weights = self.layout.weights  # checked first: with them beside, a mismatched pair is a stale graph
        if weights.is_file() and found != self._sha256_beside:
            raise OnnxModelError(f"{path} was exported from other weights than the {weights.name} beside it: expected "
                                 f"sha256 {self._sha256_beside[:12]}..., found {found[:12]}...; {fix}")
        if paired_with not in (None, found):
            raise OnnxModelError(f"{path} and {self.model_path.name} were exported from different weights: expected "
                                 f"the pair one export writes, found sha256 {found[:12]}... and {paired_with[:12]}...; "
                                 f"{fix} --output-attentions")
        return found

    @functools.cached_property
    def _sha256_beside(self) -> str:
        return weights_sha256(self.layout.weights)

    @property
    def can_output_attentions(self) -> bool:
        """Whether run(..., output_attentions=True) can work (an attentions graph was exported)."""
        return self._outputs_attentions(self.session) or self.layout.attentions.is_file()

    @staticmethod
    def _outputs_attentions(session: ort.InferenceSession) -> bool:
        return GRAPH_ATTENTIONS in [output.name for output in session.get_outputs()]

    def _attentions_session(self) -> ort.InferenceSession:
        """The graph with an attentions output, loaded on first use."""
        if self._outputs_attentions(self.session):
            return self.session
        with self._attentions_lock:
            if self._attentions is None:
                path = self.layout.attentions
                if not path.is_file():
                    raise UserError(f"attentions were asked for but {path} does not exist; "
                                    f"export it with: {EXPORT_COMMAND} {self.model_path} --output-attentions")
                half = self.layout.in_precision(path, self.precision)  # an fp16 copy when there is one
                graph = half if half.is_file() else path
                session = create_session(graph, self._providers, self._threads, self.config, self._spinning)
                self._check_weights(session, graph, paired_with=self.weights_sha256)
                self._attentions = session
        return self._attentions

    # Inference ---------------------------------------------------------------------
    def run(self, pixel_values: np.ndarray, output_attentions: bool = False):
        """float32 [B, C, H, W] -> logits [B, classes]; with output_attentions=True, (logits,
        attentions [depth, B, heads, T, T]) from the attentions graph. NumPy in, NumPy out."""
        pixels = check_pixel_values(pixel_values, self.config)
        if not output_attentions:
            return self._run(self.session, [GRAPH_LOGITS], pixels)[0]
        logits, weights = self._run(self._attentions_session(), [GRAPH_LOGITS, GRAPH_ATTENTIONS], pixels)
        return logits, weights

    def _run(self, session: ort.InferenceSession, outputs: list[str], pixels: np.ndarray) -> list[np.ndarray]:
        """One run; onnxruntime's own failures (out of memory, a kernel error) as OnnxModelError."""
        try:
            return self._run_once(session, outputs, pixels)
        except ORT_ERRORS as error:
            graph = self.layout.attentions if session is not self.session else self.model_path
            raise OnnxModelError(f"{graph}: expected onnxruntime to run it on pixel_values {list(pixels.shape)}, "
                                 f"got an error ({ort_detail(error)})") from None

    def _run_once(self, session: ort.InferenceSession, outputs: list[str], pixels: np.ndarray) -> list[np.ndarray]:
        if not self._io_binding:
            return session.run(outputs, {GRAPH_INPUT: pixels}, QUIET_RUN)
        binding = session.io_binding()
        binding.bind_cpu_input(GRAPH_INPUT, pixels)  # copied to the device once
        for name in outputs:
            binding.bind_output(name, self._device)  # allocated on the device by onnxruntime
        session.run_with_iobinding(binding, QUIET_RUN)
        return binding.copy_outputs_to_cpu()

    def preprocess(self, images: Sequence[ImageInput]) -> np.ndarray:
        """Images (paths, PIL images, arrays) -> float32 [B, C, H, W] as the config says."""
        return preprocess_batch(list(images), self.config)

    def predict(self, images: ImageInput | Sequence[ImageInput], top_k: int = 5, batch_size: int = 64):
        """Top-k (label, probability) pairs, best first: a list for one image, a list of
        such lists for a list of images."""
        self.config.check_has_head("predict")
        single = not isinstance(images, (list, tuple))
        images = [images] if single else list(images)
        if not images:
            raise ValueError("expected at least one image, got an empty list")
        ranked = []
        for start in range(0, len(images), batch_size):
            logits = self.run(self.preprocess(images[start:start + batch_size]))
            ranked += rank_top_k(softmax(logits, self.config.temperature), self.config.labels, top_k)
        return ranked[0] if single else ranked

    def __repr__(self) -> str:
        return f"OnnxClassifier({str(self.model_path)!r}, providers={self.providers})"


def check_pixel_values(pixel_values: Any, config: ViTConfig) -> np.ndarray:
    """Contiguous float32 [B, C, H, W] as `config` says; else ValueError/TypeError naming
    expected vs got (a caller's programming error: images go through predict() or preprocess())."""
    channels, (height, width) = config.in_channels, config.image_size
    expected = f"[batch, {channels}, {height}, {width}]"
    if not isinstance(pixel_values, np.ndarray):
        raise TypeError(f"expected pixel_values as a NumPy array {expected}, got {type(pixel_values).__name__} "
                        f"(for images, use predict() or preprocess())")
    if pixel_values.ndim != 4:
        raise ValueError(f"expected pixel_values of rank 4 {expected}, got rank {pixel_values.ndim} "
                         f"with shape {list(pixel_values.shape)} (for images, use predict() or preprocess())")
    if not np.issubdtype(pixel_values.dtype, np.floating):
        raise ValueError(f"expected float pixel_values (normalised by preprocess()), got dtype {pixel_values.dtype}")
    batch, got_channels, got_height, got_width = pixel_values.shape
    if batch == 0:
        raise ValueError(f"expected at least one image in pixel_values {expected}, got batch size 0")
    if got_channels != channels:
        raise ValueError(f"expected {channels} input channels {expected}, got {got_channels}")
    if (got_height, got_width) != (height, width):
        raise ValueError(f"expected images of {size_text((height, width))} pixels {expected}, "
                         f"got {size_text((got_height, got_width))}")
    return np.ascontiguousarray(pixel_values, dtype=np.float32)
