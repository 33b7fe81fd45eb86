"""Images in, scores out, from the config alone and without torch: `preprocess.py` (any
image -> the model's input), `canonical.py` (a photographed or drawn digit -> an MNIST-like
one) and `postprocess.py` (logits -> calibrated probabilities and ranked labels). Training,
evaluation, ONNX Runtime, `pipeline.onnx` and the app all go through these."""
