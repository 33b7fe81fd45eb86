"""What every exported graph must pass before anyone runs it:

  * `onnx.checker` (full check, with shape inference), and what ONNX Runtime asks of every
    graph it loads (`graph_check.check_graph`: known operators, bounded memory);
  * the opset actually written is the one asked for;
  * one self-contained file (no external weights) with input `pixel_values` whose batch axis
    is symbolic, and outputs `logits` (and `attentions`), all float32 (fp16 graphs included);
  * parity with the torch model in ONNX Runtime on the provider a classifier gets here ("auto":
    CUDA where it starts, run exact, i.e. `use_tf32=0`; else the CPU), on random and on real
    images, at batch 1 and 7: logits within 1e-4, attentions within 1e-5 (max absolute difference).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx.external_data_helper import uses_external_data
from torch import nn

from vit_hub.layout import GRAPH_ATTENTIONS, GRAPH_INPUT, GRAPH_LOGITS

from .graph_check import value_dims
from .session import create_session, requested_providers

TOLERANCES = {GRAPH_LOGITS: 1e-4, GRAPH_ATTENTIONS: 1e-5}
PARITY_BATCHES = (1, 7)


class VerificationError(RuntimeError):
    """An exported graph failed a check; the export report says which."""


def check_file(path: Path, opset: int, outputs: list[str]) -> dict[str, Any]:
    """Static checks of the file; raises VerificationError on the first that fails."""
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except onnx.checker.ValidationError as error:
        raise VerificationError(f"{path} fails onnx.checker: {error}") from None
    model = onnx.load(str(path), load_external_data=False)
    written = {entry.domain or "ai.onnx": entry.version for entry in model.opset_import}
    if written.get("ai.onnx") != opset:
        raise VerificationError(f"{path}: asked for opset {opset}, the file says {written.get('ai.onnx')}")
    if any(uses_external_data(tensor) for tensor in model.graph.initializer):
        raise VerificationError(f"{path} keeps weights in external data; expected one self-contained file")
    inputs = {value.name: value_dims(value) for value in model.graph.input}
    found = {value.name: value_dims(value) for value in model.graph.output}
    if list(inputs) != [GRAPH_INPUT] or list(found) != outputs:
        raise VerificationError(f"{path}: expected input {[GRAPH_INPUT]} and outputs {outputs}, "
                                f"got {list(inputs)} and {list(found)}")
    wrong_types = [value.name for value in [*model.graph.input, *model.graph.output]
                   if value.type.tensor_type.elem_type != onnx.TensorProto.FLOAT]
    if wrong_types:
        raise VerificationError(f"{path}: expected float32 inputs and outputs, got other types for {wrong_types}")
    if not isinstance(inputs[GRAPH_INPUT][0], str):
        raise VerificationError(f"{path}: expected a symbolic batch axis, got {GRAPH_INPUT} {inputs[GRAPH_INPUT]}")
    return {"file": path.name, "bytes": path.stat().st_size, "self_contained": True, "checker": "passed",
            "opset": written["ai.onnx"], "opset_imports": written, "inputs": inputs, "outputs": found}


def _torch_outputs(model: nn.Module, pixels: np.ndarray, output_attentions: bool) -> list[np.ndarray]:
    with torch.inference_mode():
        logits, weights = model(torch.from_numpy(pixels), output_attentions=output_attentions)
    return [logits.numpy()] + ([torch.stack(weights).numpy()] if output_attentions else [])


def parity(model: nn.Module, path: Path, inputs: dict[str, np.ndarray], outputs: list[str]) -> list[dict[str, Any]]:
    """Max |onnx - torch| per output, for each kind of input at each parity batch size."""
    session = create_session(path, requested_providers("auto", exact=True)[0], config=model.config)
    rows = []
    for kind, pixels in inputs.items():
        for batch in PARITY_BATCHES:
            sample = pixels[:batch]  # [batch, C, H, W]
            expected = _torch_outputs(model, sample, GRAPH_ATTENTIONS in outputs)
            got = session.run(outputs, {GRAPH_INPUT: sample})
            row: dict[str, Any] = {"input": kind, "batch": len(sample), "provider": session.get_providers()[0]}
            for name, ours, reference in zip(outputs, got, expected):
                if ours.shape != reference.shape:
                    raise VerificationError(f"{path}: {name} has shape {list(ours.shape)}, torch gives "
                                            f"{list(reference.shape)} (input {kind}, batch {len(sample)})")
                row[f"{name}_max_abs_diff"] = float(np.abs(ours - reference).max())
            rows.append(row)
    return rows


def parity_failures(rows: list[dict[str, Any]], tolerances: dict[str, float] = TOLERANCES) -> list[str]:
    """Human-readable descriptions of every difference above its tolerance."""
    failures = []
    for row in rows:
        for name, tolerance in tolerances.items():
            diff = row.get(f"{name}_max_abs_diff")
            if diff is not None and not diff <= tolerance:  # `not <=` also catches NaN
                failures.append(f"{name} differ by {diff:.2e} > {tolerance:.0e} on {row['input']} input, batch {row['batch']}")
    return failures


def verify_graph(model: nn.Module, path: Path, opset: int, inputs: dict[str, np.ndarray],
                 output_attentions: bool, tolerances: dict[str, float] = TOLERANCES) -> dict[str, Any]:
    """Static checks and parity of one graph -> its section of the export report."""
    outputs = [GRAPH_LOGITS, GRAPH_ATTENTIONS] if output_attentions else [GRAPH_LOGITS]
    report = check_file(path, opset, outputs)
    report["parity"] = parity(model, path, inputs, outputs)
    report["tolerances_max_abs_diff"] = tolerances
    report["failures"] = parity_failures(report["parity"], tolerances)
    report["passed"] = not report["failures"]
    return report
