"""Gradio demo: classify an image with a vit_hub model and show where it looked.

    python app.py                                   # bundled MNIST model, torch backend
    python app.py --model user/repo --backend onnx --port 8000

The page takes an uploaded image (or, for a digit model, a drawing), shows the top-k
classes, a map of how much each patch supports the predicted class and the attention rollout
layer by layer. API callers get named endpoints: /predict (labels and the map as numbers),
/predict_labels (labels alone), /explain (labels and the page's pictures).

This file only starts the app, so that `python app.py` works in a clone and in a Hugging Face
Space alike; the parts live in `vit_hub.demo` (backends, uploads, pictures, methods, page,
server).
"""

from vit_hub.demo.server import main

if __name__ == "__main__":
    main()
