"""`export_onnx`: model dir or Hub repo id -> verified ONNX graphs, config and report.

    export_onnx("models/vit-mnist", "models/vit-mnist/model.onnx", output_attentions=True)

writes (see `layout.py`) the logits graph, optionally the attentions graph and an int8
graph, the `config.json` a consumer needs (preprocessing and labels) and an export report.
Every graph is verified (`verify.py`); a failed check installs nothing and raises
VerificationError, its report kept beside as `model_export_report.failed.json` so the numbers
can be read.

Safe for the folder it writes to (`out_folder.py`): a file there is replaced or removed only
where an export wrote it, else the export refuses before any work; everything is written into
a staging folder inside it first and moved in with os.replace once complete, graphs first and
the report last, so a kill leaves each file whole (the old one or the new one), never cut short. Every graph carries the sha256 of the
weights it came from (`graph_check.WEIGHTS_SHA256`), so ONNX Runtime refuses a new logits
graph beside an old attentions graph, or graphs beside weights retrained since: re-running
the same export command after a retrain is all it takes to bring them back in step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime
import safetensors.torch
import torch
from torch import nn

from vit_hub.errors import UserError
from vit_hub.explain.attribution import METHODS
from vit_hub.explain.opening import opening_method_of
from vit_hub.hub.pretrained import load_model
from vit_hub.hub.repos import resolve_model_dir
from vit_hub.layout import GRAPH_LOGITS, ExportLayout
from vit_hub.model.config import ViTConfig

from .evalset import EvalSet, check_labels, default_eval_set, first_images, first_uploads, load_eval_set
from .exporter import check_export_options, write_graph
from .fused_graph import ort_fusions, ort_operators
from .graph_check import WEIGHTS_SHA256, weights_sha256
from .half import FP16_TOLERANCES, convert_to_fp16, measure_fp16
from .gradient_graph import GRAPH_METHODS, verify_explain_pipeline, write_explain_pipeline
from .map_graph import verify_map_pipeline, write_map_pipeline
from .pipeline_graph import (FP16_PROBABILITY_TOLERANCE, PROBABILITY_TOLERANCE, VERIFY_IMAGES, verification_uploads,
                             verify_pipeline, write_pipeline)
from .out_folder import check_out_folder, install, keep_failed_report, staging, write_config
from .options import DEFAULT_EXPORTER, DEFAULT_OPSET, PRECISIONS, QUANTIZATIONS
from .preprocess_graph import verify_preprocessing, write_preprocessing
from .quantize import measure_int8, quantize_int8
from .verify import PARITY_BATCHES, TOLERANCES, VerificationError, check_file, verify_graph

def _resolve_model(model: nn.Module | str | Path) -> tuple[str, nn.Module, str, Path | None]:
    """(how the report names the model, the model in eval mode, the sha256 of its weights: of
    its model.safetensors, or of its weights serialised as safetensors for a model in memory,
    its local folder: None for a model in memory)."""
    if isinstance(model, nn.Module):
        if not isinstance(getattr(model, "config", None), ViTConfig):
            raise TypeError(f"expected a vit_hub VisionTransformer, got {type(model).__name__}")
        weights = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
        return (f"<in-memory {type(model).__name__}>", model.eval(),
                hashlib.sha256(safetensors.torch.save(weights)).hexdigest(), None)
    model_dir = resolve_model_dir(model)
    return str(model), load_model(model_dir), weights_sha256(ExportLayout.for_model(model_dir).weights), model_dir


def tie_to_weights(graph: Path, sha256: str) -> None:
    """Write the sha256 of the weights a graph came from into its metadata_props."""
    proto = onnx.load(str(graph))
    onnx.helper.set_model_props(proto, {**{entry.key: entry.value for entry in proto.metadata_props},
                                        WEIGHTS_SHA256: sha256})
    onnx.save(proto, str(graph))


def _parity_inputs(config: ViTConfig, eval_set: EvalSet) -> dict[str, np.ndarray]:
    count = max(PARITY_BATCHES)
    shape = (count, config.in_channels, *config.image_size)
    return {"random": np.random.default_rng(0).normal(size=shape).astype(np.float32),
            "real": first_images(eval_set, count)}


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    """What `export_onnx` writes and how it measures it, checked when made: each bad value is a
    one-line UserError naming its flag.

    Args:
        opset: ONNX opset to write (checked in the written file).
        output_attentions: also write `<stem>_attentions.onnx` with an `attentions` output.
        exporter: "torchscript" (default, faster graph here) or "dynamo".
        quantize: None or "int8" (dynamic quantization; needs labelled data to be measured).
        calib_data: images (any --data the core accepts) for the real-input parity check and
            the int8 accuracy; default: images that fit the model (`evalset.default_eval_set`).
        data_root: where torchvision datasets named by calib_data live.
        eval_limit: measure int8 accuracy (and fp16 agreement) on the first N images only.
        precision: "fp32", or "fp16" to also write float16 copies of the graphs for the CUDA
            provider (`model_fp16.onnx` in ONNX Runtime's fused form, ...; see half.py and
            fused_graph.py), verified and measured.
    """

    opset: int = DEFAULT_OPSET
    output_attentions: bool = False
    exporter: str = DEFAULT_EXPORTER
    quantize: str | None = None
    calib_data: str | None = None
    data_root: str | None = None
    eval_limit: int | None = None
    precision: str = "fp32"

    def __post_init__(self) -> None:
        check_export_options(self.exporter, self.opset)
        if self.quantize is not None and self.quantize not in QUANTIZATIONS:
            raise UserError(f"--quantize: expected one of {', '.join(QUANTIZATIONS)}, got {self.quantize!r}")
        if self.precision not in PRECISIONS:
            raise UserError(f"--precision: expected one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.eval_limit is not None and self.eval_limit < 1:
            raise UserError(f"--eval-limit: expected a positive number of images, got {self.eval_limit}")

    @property
    def precisions(self) -> tuple[str, ...]:
        """The precisions each graph is written in: fp32, and fp16 beside it when asked for."""
        return ("fp32", "fp16") if self.precision == "fp16" else ("fp32",)


def export_onnx(model: nn.Module | str | Path, out: str | Path, **options: Any) -> Path:
    """Export, verify and report; returns the path of the logits graph.

    Args:
        model: a model dir, a Hub repo id, or a loaded VisionTransformer.
        out: a folder (gets model.onnx) or a path ending in .onnx.
        options: the fields of `ExportOptions` (opset, output_attentions, exporter, quantize,
            calib_data, data_root, eval_limit, precision), checked before any work.
    """
    options = ExportOptions(**options)
    reference, model, weights, model_dir = _resolve_model(model)
    layout = ExportLayout.for_output(out)
    layout.folder.mkdir(parents=True, exist_ok=True)
    eval_set = (load_eval_set(options.calib_data, model.config, options.data_root) if options.calib_data
                else default_eval_set(model.config, model_dir, options.data_root))
    if options.quantize:
        check_labels(eval_set, model.config)  # before any work: int8 accuracy needs the model's classes
    inputs = _parity_inputs(model.config, eval_set)

    check_out_folder(layout, model.config, weights if model_dir is not None else None)

    with staging(layout) as staged:
        write_config(model.config, staged.config)  # the classifiers that measure the graphs read it
        graphs = _write_verified_graphs(model, staged, weights, inputs, options)
        pipelines = _write_verified_pipelines(staged, weights, model.config, eval_set, options.precisions)
        if options.output_attentions:
            pipelines.update(_write_verified_map_pipeline(staged, weights, model.config, eval_set))
            pipelines.update(_write_verified_explain_pipeline(model, model_dir, staged, weights, eval_set))
        preprocessing = _write_verified_preprocessing(staged, weights, model.config, eval_set)
        measured = {}
        if options.quantize:
            graphs[staged.int8.name], measured["quantization"] = _write_measured_int8(staged, weights, eval_set, options)
        if options.precision == "fp16":
            measured["fp16"] = measure_fp16(staged.logits, staged.in_precision(staged.logits, "fp16"), eval_set,
                                            options.eval_limit)
        report = {**_report_header(reference, options, eval_set), "graphs": graphs, "pipeline": pipelines,
                  "preprocess": preprocessing, **measured}
        staged.report.write_text(json.dumps(report, indent=2) + "\n")
        failures = [failure for section in (*graphs.values(), *pipelines.values(), preprocessing)
                    for failure in section.get("failures", [])]
        if failures:
            keep_failed_report(staged, layout)
            raise VerificationError(f"export verification failed, nothing installed: {'; '.join(failures)} "
                                    f"(report: {layout.failed_report})")
        install(staged, layout, model.config)
    return layout.logits


def _write_verified_graphs(model: nn.Module, staged: ExportLayout, weights: str, inputs: dict[str, np.ndarray],
                           options: ExportOptions) -> dict[str, Any]:
    """Write the logits graph (the attentions graph too, and with fp16 a float16 copy of each),
    tie each to the weights and verify it -> {file name: its section of the report}."""
    sections = {}
    graphs = [(staged.logits, False)] + ([(staged.attentions, True)] if options.output_attentions else [])
    for path, with_attentions in graphs:
        write_graph(model, path, output_attentions=with_attentions, opset=options.opset, exporter=options.exporter)
        tie_to_weights(path, weights)
        sections[path.name] = verify_graph(model, path, options.opset, inputs, with_attentions)
        if options.precision == "fp16":
            half = _write_fp16(model, path, staged.in_precision(path, "fp16"), with_attentions, options)
            tie_to_weights(half, weights)
            sections[half.name] = verify_graph(model, half, options.opset, inputs, with_attentions, FP16_TOLERANCES)
            sections[half.name]["onnxruntime_operators"] = ort_operators(half)
    return sections


def _write_fp16(model: nn.Module, graph: Path, target: Path, with_attentions: bool, options: ExportOptions) -> Path:
    """The float16 copy of `graph` at `target`. A logits graph from the torchscript exporter is
    first written again in ONNX Runtime's fused form (fused_graph.py): the copy is for its
    CUDA provider, which then runs each block's attention as one kernel."""
    if with_attentions or options.exporter != "torchscript":
        return convert_to_fp16(graph, target)
    fused = target.with_name(f"{target.stem}.fused.tmp")
    try:
        write_graph(model, fused, output_attentions=False, opset=options.opset, exporter=options.exporter,
                    fused_attention=True)
        return convert_to_fp16(ort_fusions(fused, fused, model.config), target)
    finally:
        fused.unlink(missing_ok=True)


def _write_verified_pipelines(staged: ExportLayout, weights: str, config: ViTConfig, eval_set: EvalSet,
                              precisions: tuple[str, ...]) -> dict[str, Any]:
    """Write pipeline.onnx (and with fp16 its float16 copy) from the staged logits graph, tie it
    to the weights and check it against the Python path on uploads made from real images; a
    graph that disagrees is removed, not installed -> {file name: its section of the report}."""
    uploads = verification_uploads(first_uploads(eval_set, VERIFY_IMAGES), config)
    tolerances = {"fp32": PROBABILITY_TOLERANCE, "fp16": FP16_PROBABILITY_TOLERANCE}
    sections = {}
    for chosen in precisions:
        target = staged.in_precision(staged.pipeline, chosen)
        write_pipeline(staged.in_precision(staged.logits, chosen), target, config)
        tie_to_weights(target, weights)
        sections[target.name] = verify_pipeline(target, staged.logits, config, uploads, tolerances[chosen])
        if sections[target.name]["failures"]:
            target.unlink()
    return sections


def _write_verified_preprocessing(staged: ExportLayout, weights: str, config: ViTConfig,
                                  eval_set: EvalSet) -> dict[str, Any]:
    """Write preprocess.onnx (pipeline.onnx's preprocessing alone, for the CPU provider beside a
    batched network), tie it to the weights and check it against the Python path on the uploads
    pipeline.onnx is checked on; a graph that disagrees is removed, not installed -> its
    section of the report."""
    uploads = verification_uploads(first_uploads(eval_set, VERIFY_IMAGES), config)
    target = write_preprocessing(staged.preprocess, config)
    tie_to_weights(target, weights)
    section = verify_preprocessing(target, config, uploads)
    if section["failures"]:
        target.unlink()
    return section


def _write_verified_map_pipeline(staged: ExportLayout, weights: str, config: ViTConfig,
                                 eval_set: EvalSet) -> dict[str, Any]:
    """Write pipeline_map.onnx from the staged attentions graph, tie it to the weights and check
    its probabilities, map and model input against the Python path on pipeline.onnx's uploads; a
    graph that disagrees is removed, not installed -> {file name: its section of the report}."""
    uploads = verification_uploads(first_uploads(eval_set, VERIFY_IMAGES), config)
    write_map_pipeline(staged.attentions, staged.pipeline_map, config)
    tie_to_weights(staged.pipeline_map, weights)
    section = verify_map_pipeline(staged.pipeline_map, staged.logits, staged.attentions, config, uploads)
    if section["failures"]:
        staged.pipeline_map.unlink()
    return {staged.pipeline_map.name: section}


def _write_verified_explain_pipeline(model: nn.Module, model_dir: Path | None, staged: ExportLayout, weights: str,
                                     eval_set: EvalSet) -> dict[str, Any]:
    """Write pipeline_explain.onnx (the page's opening map, `opening_method_of` the model dir),
    tie it to the weights and check it against the torch page on pipeline.onnx's uploads; a graph
    that disagrees is removed, not installed; an opening method the graph does not compute is
    said in the section instead -> {file name: its section of the report}."""
    method = opening_method_of(model_dir, tuple(METHODS))
    if method not in GRAPH_METHODS:
        return {staged.pipeline_explain.name: {"skipped": f"the page opens with {method}; the graph computes "
                                                          f"{', '.join(GRAPH_METHODS)}", "failures": []}}
    uploads = verification_uploads(first_uploads(eval_set, VERIFY_IMAGES), model.config)
    write_explain_pipeline(model, method, staged.pipeline_explain)
    tie_to_weights(staged.pipeline_explain, weights)
    section = verify_explain_pipeline(staged.pipeline_explain, staged.logits, staged.attentions, model, uploads)
    if section["failures"]:
        staged.pipeline_explain.unlink()
    return {staged.pipeline_explain.name: section}


def _write_measured_int8(staged: ExportLayout, weights: str, eval_set: EvalSet,
                         options: ExportOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    """Quantize the staged logits graph to int8, tie it to the weights and check it -> (its
    section of the report's graphs, its accuracy and speed beside fp32's)."""
    quantize_int8(staged.logits, staged.int8)
    tie_to_weights(staged.int8, weights)
    return (check_file(staged.int8, options.opset, [GRAPH_LOGITS]),
            measure_int8(staged.logits, staged.int8, eval_set, options.eval_limit))


def _report_header(reference: str, options: ExportOptions, eval_set: EvalSet) -> dict[str, Any]:
    """What the graphs came from and how they are checked: the report's first keys."""
    return {
        "model": reference,
        "exporter": options.exporter, "opset": options.opset,
        "versions": {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__},
        "parity": {"tolerances_max_abs_diff": TOLERANCES, "batches": list(PARITY_BATCHES),
                   "random_input": "standard normal pixel_values, seed 0",
                   "real_input": f"first {max(PARITY_BATCHES)} images of {eval_set.description}",
                   "provider": "as OnnxClassifier's 'auto' picks here, exact (CUDA with use_tf32=0); "
                               "each parity row names it"},
    }
