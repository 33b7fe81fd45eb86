"""vit_hub.export: vit_hub models as ONNX graphs, run with ONNX Runtime.

    python -m vit_hub.export --model models/vit-mnist --out models/vit-mnist/model.onnx --output-attentions

    from vit_hub.export import OnnxClassifier     # torch-free
    classifier = OnnxClassifier("models/vit-mnist/model.onnx")
    classifier.predict("digit.png", top_k=3)

The sources live in the checkout's top-level `export/` folder; they install as the subpackage
`vit_hub.export` (pyproject.toml maps the folder), because a top-level package named `export`
would collide with any other package of that name in a user's environment.

Importing the package is light: `OnnxClassifier` needs only onnxruntime, NumPy and PIL;
the exporting names (which need torch) load on first use.
"""

from importlib import import_module

_LAZY = {
    "OnnxClassifier": ".runtime", "OnnxModelError": ".graph_check", "ProviderFallbackError": ".session",
    "ExportLayout": "vit_hub.layout",
    "export_onnx": ".export_model", "ensure_graphs": ".on_demand", "open_exporting": ".on_demand",
    "VerificationError": ".verify",
    "quantize_int8": ".quantize",
}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
