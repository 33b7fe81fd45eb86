"""export: vit_hub models as ONNX graphs, run with ONNX Runtime.

    python -m export --model models/vit-mnist --out models/vit-mnist/model.onnx --output-attentions

    from export import OnnxClassifier          # torch-free
    classifier = OnnxClassifier("models/vit-mnist/model.onnx")
    classifier.predict("digit.png", top_k=3)

Importing the package is light: `OnnxClassifier` needs only onnxruntime, NumPy and PIL;
the exporting names (which need torch) load on first use.
"""

from importlib import import_module

_LAZY = {
    "OnnxClassifier": "export.runtime", "ProviderFallbackError": "export.runtime", "OnnxModelError": "export.runtime",
    "ExportLayout": "vit_hub.layout",
    "export_onnx": "export.pipeline",
    "VerificationError": "export.verify",
    "quantize_int8": "export.quantize",
}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'export' has no attribute {name!r}")
