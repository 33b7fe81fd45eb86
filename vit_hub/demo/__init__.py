"""The Gradio demo's parts; `app.py` at the top of the checkout starts it (and is what a
Hugging Face Space runs). Imports point app.py -> vit_hub.demo -> export -> the rest of vit_hub.

    backends.py   the model behind the page: PyTorch or ONNX Runtime, one `Predictor` protocol
    uploads.py    what a request sends: uploads and drawings checked, errors without server paths
    pictures.py   the answer drawn: the map over the image, the per-layer strip, the head grid
    methods.py    which explanation the page opens with, and how faithful each one measured
    page.py       the Gradio Blocks: the Classify and Inside tabs and the named API endpoints
    server.py     app.py's flags, address and signals; `main()`
"""
