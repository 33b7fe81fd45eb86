"""Bad input, as an attacker and as a careless user would give it.

Every case asserts: a non-zero exit or the project's own exception; one line that names what
was expected and what was found; no traceback; nothing half-written; and, for the app, that
it still serves afterwards. Offline and deterministic; images that would be huge when
decoded are written row by row, so they cost kilobytes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import zlib
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from conftest import (TINY_TRAIN_FLAGS, assert_one_line, call, file_data, free_port, run_app_main, tiny_config, upload,
                      write_class_folders)

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402

import vit_hub  # noqa: E402
from vit_hub import cli  # noqa: E402
from vit_hub.demo import uploads  # noqa: E402
from vit_hub.export import OnnxClassifier, OnnxModelError, export_onnx  # noqa: E402
from vit_hub.export.__main__ import main as export_main  # noqa: E402
from vit_hub.hub.pretrained import HubVisionTransformer, load_model, predict_images  # noqa: E402
from vit_hub.layout import ModelDir  # noqa: E402
from vit_hub.processing.preprocess import open_image, pixel_limit  # noqa: E402
from vit_hub.train.loop import Trainer  # noqa: E402
from vit_hub.train.settings import TrainingError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BUNDLED_MODEL = REPO / "models" / "vit-mnist"
SERVER_FILE = BUNDLED_MODEL / "confusion_matrix.png"  # a real image on the server, never uploaded
SAMPLE = REPO / "vit_hub" / "bundled" / "samples" / "mnist_test_0000_label_7.png"


# Bad files ----------------------------------------------------------------------------------
def blank_png(path: Path, width: int, height: int) -> Path:
    """A genuine 1-bit PNG of any size, compressed row by row: kilobytes on disk, however
    many megapixels it decodes to."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    compressor, row = zlib.compressobj(1), b"\x00" * (1 + (width + 7) // 8)  # filter byte + packed bits
    pixels = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # 1 bit, grayscale
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b""))
    return path


def truncated_jpeg(path: Path, share: float = 0.9) -> Path:
    """A photo-like JPEG cut after `share` of its bytes: PIL's verify() accepts it, decoding fails."""
    noise = np.random.default_rng(0).integers(0, 256, size=(48, 64, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noise).save(buffer, format="JPEG", quality=90)
    path.write_bytes(buffer.getvalue()[:int(len(buffer.getvalue()) * share)])
    return path


class Payload:
    """Unpickling this creates `marker`: proof that a pickle was (or was not) loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def damaged_copy(model_dir: Path, folder: Path, how: str) -> Path:
    """A copy of a model dir whose model.safetensors is damaged `how`."""
    shutil.copytree(model_dir, folder)
    weights = folder / "model.safetensors"
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "pickle":
        weights.write_bytes(pickle.dumps(Payload(folder / "UNPICKLED"), protocol=2))
    elif how == "torch.save":
        torch.save({"weight": torch.zeros(2)}, weights)
    elif how == "empty":
        weights.write_bytes(b"")
    return folder


# Assertions -----------------------------------------------------------------------------------



def listing(folder: Path) -> dict[str, int]:
    """Every file under `folder` with its size: compared before and after, nothing half-written."""
    return {str(path.relative_to(folder)): path.stat().st_size for path in sorted(folder.rglob("*"))
            if path.is_file()}


def run_vit_hub(*argv) -> tuple[int, str]:
    """`vit-hub ARGV` in this process: (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli.main([str(arg) for arg in argv])
    return code, err.getvalue()


def run_export(*argv) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = export_main([str(arg) for arg in argv])
    return code, err.getvalue()





def run_module(module: str, *argv) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGV` in a fresh process, offline, as a user would run it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", module, *map(str, argv)], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=180)


# Fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny RGB model dir (16x16, two classes) with its ONNX graphs."""
    folder = tmp_path_factory.mktemp("bad_input_model")
    HubVisionTransformer(**tiny_config()).save_pretrained(folder)
    export_onnx(folder, folder, output_attentions=True)
    return folder


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """W, a scratch folder with bad images of every kind."""
    scratch = tmp_path_factory.mktemp("W")
    (scratch / "notes.png").write_text("not an image")
    return {"huge": blank_png(scratch / "huge.png", 20_000, 20_000),  # 400 MP: PIL's own bomb error
            "144mp": blank_png(scratch / "144mp.png", 12_000, 12_000),  # past MAX_PIXELS, under PIL's error
            "truncated": truncated_jpeg(scratch / "cut.jpg"), "text": scratch / "notes.png",
            "good": SAMPLE, "scratch": scratch}


# Images: CLI, Python API and ONNX Runtime -----------------------------------------------------
IMAGE_CASES = {
    "huge": "is too large: expected at most 64 megapixels, found more than",
    "144mp": "is too large: expected at most 64 megapixels, found 12000x12000 (144 megapixels)",
    "truncated": "is not a readable image: expected complete image data, found data that does not decode",
    "text": "is not a readable image: expected a format Pillow reads",
}


@pytest.mark.parametrize("case", IMAGE_CASES)
def test_vit_hub_predict_refuses_bad_images_in_one_line(model_dir, files, case):
    before = listing(files["scratch"])
    code, stderr = run_vit_hub("predict", "--model", model_dir, files["good"], files[case])
    assert code == 2
    assert_one_line(stderr, str(files[case]), IMAGE_CASES[case])
    assert listing(files["scratch"]) == before


@pytest.mark.parametrize("case", IMAGE_CASES)
def test_predict_images_and_onnx_predict_raise_one_line_value_errors(model_dir, files, case):
    model = load_model(model_dir)
    for predict in (lambda images: predict_images(model, images), OnnxClassifier(model_dir).predict):
        with pytest.raises(ValueError) as error:
            predict([files["good"], files[case]])
        assert_one_line(str(error.value), IMAGE_CASES[case])


def test_a_144_megapixel_image_is_refused_before_it_is_decoded(files, monkeypatch):
    def no_decoding(image):
        raise AssertionError(f"decoded {image.size} before checking its size")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    with pytest.raises(ValueError) as error:
        open_image(files["144mp"])
    assert_one_line(str(error.value), "found 12000x12000")


def test_predict_on_a_20000_pixel_png_exits_with_one_line(files):
    """`vit-hub predict --model models/vit-mnist W/huge.png` from the repo root, in a real process."""
    result = run_module("vit_hub", "predict", "--model", BUNDLED_MODEL, files["huge"])
    assert result.returncode == 2 and result.stdout == ""
    assert_one_line(result.stderr, "huge.png is too large")


# Weights: CLI, Python API, export and app ---------------------------------------------------------
WEIGHT_CASES = {
    "truncated": "expected a complete safetensors file at",
    "pickle": "found a Python pickle, which vit_hub never loads",
    "torch.save": "found a zip archive (torch.save's format?)",
    "empty": "found 0 bytes, too few for a safetensors header",
}


@pytest.mark.parametrize("how", WEIGHT_CASES)
def test_damaged_weights_are_one_line_in_every_entry_point(model_dir, files, tmp_path, how):
    broken = damaged_copy(model_dir, tmp_path / "broken", how)
    code, stderr = run_vit_hub("predict", "--model", broken, files["good"])
    assert code == 2
    assert_one_line(stderr, str(broken / "model.safetensors"), WEIGHT_CASES[how])
    code, stderr = run_export("--model", broken, "--out", tmp_path / "onnx")
    assert code == 2
    assert_one_line(stderr, WEIGHT_CASES[how])
    assert not (tmp_path / "onnx").exists()
    assert_one_line(run_app_main("--model", broken, "--port", free_port()), "cannot load --model", WEIGHT_CASES[how])
    with pytest.raises(ValueError) as error:
        HubVisionTransformer.from_pretrained(str(broken))
    assert_one_line(str(error.value), WEIGHT_CASES[how])
    assert not (broken / "UNPICKLED").exists()  # the pickle's payload never ran


@pytest.mark.parametrize("how", ["pickle", "empty"])
def test_damaged_weights_are_never_pushed(model_dir, tmp_path, monkeypatch, how):
    from vit_hub.hub.repos import push_to_hub

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: a request would fail otherwise
    broken = damaged_copy(model_dir, tmp_path / "broken", how)
    code, stderr = run_vit_hub("push", "--model", broken, "--repo-id", "someone/model", "--token", "hf_test")
    assert code == 2
    assert_one_line(stderr, WEIGHT_CASES[how])
    with pytest.raises(ValueError) as error:
        push_to_hub(broken, "someone/model", token="hf_test")
    assert_one_line(str(error.value), WEIGHT_CASES[how])


def test_a_pickle_named_model_safetensors_is_refused_in_a_real_process(model_dir, tmp_path):
    broken = damaged_copy(model_dir, tmp_path / "broken", "pickle")
    result = run_module("vit_hub.export", "--model", broken, "--out", tmp_path / "onnx")
    assert result.returncode == 2
    assert_one_line(result.stderr, "found a Python pickle")
    assert not (broken / "UNPICKLED").exists() and not (tmp_path / "onnx").exists()


def test_weights_that_cannot_be_opened_say_so_not_no_such_file(model_dir, tmp_path, monkeypatch):
    """As root every file is readable, so the refusal is simulated where the file is opened."""
    from vit_hub import storage

    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(storage, "open", denied, raising=False)
    with pytest.raises(ValueError) as error:
        load_model(model_dir)
    line = assert_one_line(str(error.value), "found one that cannot be opened (Permission denied)")
    assert "No such file" not in line


# ONNX Runtime -----------------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"not an ONNX graph", b""], ids=["text", "empty"])
def test_a_model_onnx_that_is_not_onnx_raises_the_projects_error(model_dir, tmp_path, content):
    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    (folder / "model.onnx").write_bytes(content)
    with pytest.raises(OnnxModelError) as error:
        OnnxClassifier(folder)
    assert_one_line(str(error.value), str(folder / "model.onnx"), "expected an ONNX model onnxruntime can load")
    assert_one_line(run_app_main("--model", folder, "--backend", "onnx", "--port", free_port()),
                    "found one it cannot")


def test_a_cut_attentions_graph_fails_when_loaded_and_the_app_refuses_it_at_start(model_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    graph = folder / "model_attentions.onnx"
    graph.write_bytes(graph.read_bytes()[:1000])
    classifier = OnnxClassifier(folder)  # the logits graph is fine
    with pytest.raises(OnnxModelError) as error:
        classifier.run(np.zeros((1, 3, 16, 16), dtype=np.float32), output_attentions=True)
    assert_one_line(str(error.value), str(graph))
    assert_one_line(run_app_main("--model", folder, "--backend", "onnx", "--port", free_port()),
                    "model_attentions.onnx")


# Training -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def train_folder(tmp_path_factory) -> Path:
    """2 x 8 generated images plus one JPEG cut at 90 %."""
    root = tmp_path_factory.mktemp("train_folder")
    write_class_folders(root, per_class=8, seed=3)
    truncated_jpeg(root / "bright_disc" / "cut.jpg")
    return root


def train_cli(data: Path, out: Path, *extra) -> tuple[int, str]:
    return run_vit_hub("train", "--data", data, "--out", out, "--epochs", "1", *TINY_TRAIN_FLAGS, *extra)


@pytest.mark.parametrize("flags, fragment", [
    (["--lr", "inf"], "--lr: expected a positive, finite learning rate, got inf"),
    (["--lr", "nan"], "--lr: expected a positive, finite learning rate, got nan"),
    (["--weight-decay", "inf"], "--weight-decay: expected a finite value >= 0, got inf"),
    (["--grad-clip", "nan"], "--grad-clip: expected a positive, finite max gradient norm, got nan"),
    (["--warmup-epochs", "inf"], "--warmup-epochs: expected a finite value >= 0, got inf"),
    (["--device", "tpu"], "--device: expected auto, cpu, cuda or cuda:N, got 'tpu'"),
    (["--workers", "100000"], "--workers: expected a count from 0 to 64, got 100000"),
    (["--mean", "nan"], "mean: expected finite numbers, got [nan, nan, nan]"),
    (["--mlp-ratio", "inf"], "mlp_ratio: expected a positive ratio (hidden width embed_dim x mlp_ratio from 1 to 65,536), got inf"),
], ids=lambda value: " ".join(value) if isinstance(value, list) else None)
def test_settings_that_train_to_nan_or_cannot_run_are_refused(train_folder, tmp_path, flags, fragment):
    code, stderr = train_cli(train_folder, tmp_path / "out", *flags)
    assert code == 2
    assert_one_line(stderr.strip().splitlines()[-1], fragment)  # after the skipped-file report
    assert not (tmp_path / "out").exists()


def test_out_naming_an_existing_file_is_refused_and_left_alone(train_folder, tmp_path):
    existing = tmp_path / "notes.txt"
    existing.write_text("keep me\n")
    for extra in ([], ["--overwrite"], ["--resume"]):
        code, stderr = train_cli(train_folder, existing, *extra)
        assert code == 2
        assert_one_line(stderr.strip().splitlines()[-1], f"--out {existing}: expected a folder", "found a file")
    assert existing.read_text() == "keep me\n"


def test_sweep_out_naming_an_existing_file_is_refused_and_left_alone(train_folder, tmp_path):
    existing = tmp_path / "notes.txt"
    existing.write_text("keep me\n")
    code, stderr = run_vit_hub("sweep", "--data", train_folder, "--out", existing, "--param", "depth=1,2",
                               *TINY_TRAIN_FLAGS)
    assert code == 2
    assert_one_line(stderr, f"--out {existing}: expected a folder", "found a file")
    assert existing.read_text() == "keep me\n"


def test_a_truncated_jpeg_is_skipped_and_named_without_strict(train_folder, tmp_path):
    code, stderr = train_cli(train_folder, tmp_path / "out")
    assert code == 0, stderr
    assert "skipped 1 unreadable image(s)" in stderr and str(train_folder / "bright_disc" / "cut.jpg") in stderr
    assert "Traceback" not in stderr and (tmp_path / "out" / "model.safetensors").is_file()


def test_a_truncated_jpeg_fails_one_line_with_strict(train_folder, tmp_path):
    code, stderr = train_cli(train_folder, tmp_path / "out", "--strict")
    assert code == 2
    assert_one_line(stderr, f"unreadable image {train_folder / 'bright_disc' / 'cut.jpg'}", "image file is truncated")
    assert not (tmp_path / "out").exists()


def test_a_damaged_checkpoint_fails_resume_in_one_line(train_folder, tmp_path):
    out = tmp_path / "out"
    assert train_cli(train_folder, out)[0] == 0
    checkpoint = ModelDir(out).checkpoint
    checkpoint.write_bytes(checkpoint.read_bytes()[: checkpoint.stat().st_size // 2])
    before = listing(out)
    code, stderr = run_vit_hub("train", "--resume", "--out", out)
    assert code == 2
    assert_one_line(stderr, f"expected a complete safetensors file at {checkpoint}")
    assert listing(out) == before


def test_a_loss_that_turns_nan_stops_the_run_and_keeps_the_last_good_epoch(train_folder, tmp_path, monkeypatch):
    """Epoch 1 trains; in epoch 2 the weights turn NaN. The run stops before epoch 2 saves."""
    real_epoch = Trainer._train_epoch

    def poisoned(self, epoch):
        record = real_epoch(self, epoch)
        if epoch == 1:
            with torch.no_grad():
                self.model.head.weight.fill_(float("nan"))
            record["train_loss"] = float("nan")
        return record

    monkeypatch.setattr(Trainer, "_train_epoch", poisoned)
    out = tmp_path / "out"
    code, stderr = train_cli(train_folder, out, "--epochs", "3")
    assert code == 2
    assert_one_line(stderr.strip().splitlines()[-1], "epoch 2: expected a finite loss, got train_loss nan",
                    "checkpoint after epoch 1")
    metrics = json.loads((out / "metrics.json").read_text())
    assert [record["epoch"] for record in metrics["history"]] == [1]
    model = load_model(out)  # the best (only) good epoch, complete and finite
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())
    assert "NaN" not in (out / "metrics.json").read_text()  # as json.dumps writes it


def test_the_trainer_refuses_inf_lr_through_the_python_api_too(train_folder, tmp_path):
    from vit_hub.train.run import train
    from vit_hub.train.settings import TrainSettings

    with pytest.raises(TrainingError) as error:
        train(TrainSettings(data=str(train_folder), out=str(tmp_path / "out"), lr=float("inf")))
    assert_one_line(str(error.value), "--lr")


# Kill safety of the model dir -------------------------------------------------------------------
SLOW_SAVE = textwrap.dedent("""
    import sys, time
    import safetensors.torch
    from vit_hub.hub.pretrained import HubVisionTransformer

    def slow_save(model, filename, *args, **kwargs):
        with open(filename, "wb") as handle:
            handle.write(b"half a safetensors file")
            handle.flush()
            print("SAVING", flush=True)
            time.sleep(600)

    safetensors.torch.save_model = slow_save  # what huggingface_hub's mixin calls to write the weights
    model = HubVisionTransformer(**{config})
    model.save_pretrained(sys.argv[1])
""")


def test_a_save_killed_midway_leaves_the_previous_model(tmp_path):
    """SIGKILL inside save_pretrained (the mixin alone leaves the folder without config.json)."""
    previous = HubVisionTransformer(**tiny_config())
    previous.save_pretrained(tmp_path / "model")
    config = tiny_config(labels=["cat", "dog", "fox"])
    process = subprocess.Popen([sys.executable, "-c", SLOW_SAVE.format(config=config), str(tmp_path / "model")],
                               cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "SAVING"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    loaded = HubVisionTransformer.from_pretrained(str(tmp_path / "model"))
    assert loaded.config == previous.config
    for ours, theirs in zip(loaded.state_dict().values(), previous.state_dict().values()):
        assert torch.equal(ours, theirs)


def test_a_save_that_fails_midway_leaves_the_previous_model_and_the_next_save_works(tmp_path, monkeypatch):
    import safetensors.torch

    previous = HubVisionTransformer(**tiny_config())
    previous.save_pretrained(tmp_path)
    real_save = safetensors.torch.save_model

    def failing(model, filename, *args, **kwargs):
        Path(filename).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_model", failing)
    newer = HubVisionTransformer(**tiny_config(labels=["a", "b", "c"]))
    with pytest.raises(OSError):
        newer.save_pretrained(tmp_path)
    assert HubVisionTransformer.from_pretrained(str(tmp_path)).config == previous.config
    monkeypatch.setattr(safetensors.torch, "save_model", real_save)
    newer.save_pretrained(tmp_path)
    assert HubVisionTransformer.from_pretrained(str(tmp_path)).config == newer.config
    assert sorted(path.name for path in tmp_path.iterdir()) == ["README.md", "config.json", "model.safetensors"]


# The app's command line ---------------------------------------------------------------------
@pytest.mark.parametrize("argv, fragment", [
    (["--port", "99999"], "argument --port: expected a port number from 1 to 65535, got '99999'"),
    (["--port", "http"], "argument --port: expected a port number from 1 to 65535, got 'http'"),
    (["--host", "999.1.1.1", "--port", "7999"], "--host 999.1.1.1 --port 7999: expected an address and port"),
])
def test_app_flags_that_cannot_serve_are_one_line(argv, fragment):
    assert_one_line(run_app_main(*argv), fragment)


def test_app_on_a_port_in_use_is_one_line():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert_one_line(run_app_main("--port", port), f"--port {port}: expected an address and port", "got")


# The app over raw HTTP ------------------------------------------------------------------------
# The controls after the image: head fusion, discard ratio, top-k and the explanation method.
# Plain HTTP calls give every input (gradio_client fills the method's default itself).
CONTROLS = ("mean", 0.0, 3, "rollout")


def assert_still_serving(url: str) -> None:
    event, data = call(url, "predict", [file_data(upload(url, SAMPLE), orig_name=SAMPLE.name), *CONTROLS])
    assert event == "complete" and data[0]["label"] == "7", data


def assert_refused(url: str, event: str, data, fragment: str | None = None) -> None:
    """An error event that neither shows the server file nor names a server path."""
    assert event == "error", data
    shown = json.dumps(data)
    assert str(REPO) not in shown and tempfile.gettempdir() + "/" not in shown, shown
    if fragment:
        assert_one_line(data["error"], fragment)
    assert_still_serving(url)


# Gradio's own refusals, each with the reason it logs (a server file is no upload; the request is
# not the component's data): they come before any handler of ours runs, and the client gets
# uploads.REFUSED_BY_GRADIO (Gradio itself would send {"error": null}).
NOT_UPLOADED = "InvalidPathError: Cannot move {} to the gradio cache dir because it was not uploaded by a user"
NOT_IMAGE_DATA = "validation error for ImageData"
NOT_EDITOR_DATA = "validation errors for EditorData"
NOT_AN_EXAMPLE = "Could not preprocess input component at index 0 (a `dataset` component)"


def assert_refused_by_gradio(url: str, event: str, data, server_log: str, reason: str) -> None:
    """Gradio refused the request for `reason`, found in the server's log as one line: an error
    event with the app's one line for such refusals (never Gradio's own text, which may name a
    server path), and no frame of this project's code in the log, so nothing of ours ran, let
    alone crashed."""
    assert_refused(url, event, data, uploads.REFUSED_BY_GRADIO)
    assert reason in server_log and "Traceback" not in server_log, server_log
    assert len(refused_by_gradio_log(server_log)) == 1, server_log  # one line a refusal
    ours = (f'File "{Path(vit_hub.__file__).parent}{os.sep}', f'File "{REPO / "app.py"}"')
    assert not any(frame in server_log for frame in ours), server_log


@pytest.mark.parametrize("endpoint", ["predict", "predict_labels", "explain_drawing"])
@pytest.mark.parametrize("k", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_a_top_k_that_is_no_finite_number_is_one_line(server, endpoint, k, capfd):
    image = file_data(upload(server, SAMPLE), orig_name=SAMPLE.name)
    inputs = {"predict": [image, "mean", 0.0, k, "rollout"], "predict_labels": [image, k],
              "explain_drawing": [{"background": None, "layers": [], "composite": image}, "mean", 0.0, k, "rollout"]}
    event, data = call(server, endpoint, inputs[endpoint])
    if endpoint == "explain_drawing" and abs(k) == float("inf"):  # +-inf: Gradio's slider refuses it first, in one line
        assert event == "error" and re.fullmatch(r"Value -?inf is (greater|less) than (maximum|minimum) value \d+\.",
                                                 data["error"]), data
    else:  # by the app: a user's mistake, no traceback in the log
        assert_refused(server, event, data, "top-k: expected a whole number of 1 or more")
        assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("method", [["rollout"], {"rollout": 1}], ids=["list", "dict"])
def test_a_method_that_is_no_name_is_one_line(server, method, capfd):
    image = file_data(upload(server, SAMPLE), orig_name=SAMPLE.name)
    for endpoint in ("predict", "explain"):
        event, data = call(server, endpoint, [image, "mean", 0.0, 3, method])
        assert_refused(server, event, data, "method: expected one of")
    assert "Traceback" not in capfd.readouterr().err


def upload_folder() -> Path:
    from gradio.utils import get_upload_folder

    return Path(get_upload_folder())


ONLY_UPLOADS = "Only images uploaded to this app can be classified: expected an uploaded file"


def predict_requests() -> dict[str, tuple[object, str, bool]]:
    """name -> (the image part of a /predict request naming a server file, the reason it is
    refused, whether Gradio refuses it first (the reason is in its log) or the app (the reason
    is the message))."""
    target = str(SERVER_FILE)
    return {
        "path, no meta": ({"path": target}, ONLY_UPLOADS, False),
        "file:// url": ({"url": f"file://{target}", "path": target}, ONLY_UPLOADS, False),
        "http url as path": ({"path": "http://127.0.0.1:1/x.png"}, ONLY_UPLOADS, False),
        "dot-dot out of the upload folder": ({"path": f"{upload_folder()}/../../{target}"}, ONLY_UPLOADS, False),
        "a bare string": (target, NOT_IMAGE_DATA, True),
        "path with meta": (file_data(target), NOT_UPLOADED.format(target), True),
    }


@pytest.mark.parametrize("endpoint", ["predict", "predict_labels", "explain"])
@pytest.mark.parametrize("name", predict_requests())
def test_predict_refuses_server_files(server, name, endpoint, capfd):
    image, reason, by_gradio = predict_requests()[name]
    event, data = call(server, endpoint, [image, *((3,) if endpoint == "predict_labels" else CONTROLS)])
    if by_gradio:
        assert_refused_by_gradio(server, event, data, capfd.readouterr().err, reason)
    else:
        assert_refused(server, event, data, reason)


def test_predict_refuses_a_symlink_in_the_upload_folder_to_a_server_file(server):
    folder = Path(tempfile.mkdtemp(dir=upload_folder()))
    try:
        (folder / "link.png").symlink_to(SERVER_FILE)
        event, data = call(server, "predict", [{"path": str(folder / "link.png")}, *CONTROLS])
        assert_refused(server, event, data, ONLY_UPLOADS)
    finally:
        shutil.rmtree(folder)


@pytest.mark.parametrize("meta", [False, True], ids=["no meta", "meta"])
def test_explain_drawing_refuses_server_files(server, meta, capfd):
    image = file_data(str(SERVER_FILE)) if meta else {"path": str(SERVER_FILE)}
    event, data = call(server, "explain_drawing", [{"background": image, "layers": [], "composite": image},
                                                   *CONTROLS])
    reason = NOT_UPLOADED.format(SERVER_FILE) if meta else NOT_EDITOR_DATA
    assert_refused_by_gradio(server, event, data, capfd.readouterr().err, reason)


def test_example_loading_refuses_server_files(server, capfd):
    event, data = call(server, "load_example", [{"path": str(SERVER_FILE)}])
    assert_refused_by_gradio(server, event, data, capfd.readouterr().err, NOT_AN_EXAMPLE)


def test_the_file_route_refuses_server_files(server):
    assert httpx.get(f"{server}gradio_api/file={SERVER_FILE}", timeout=60).status_code == 403
    assert_still_serving(server)


@pytest.mark.parametrize("case", IMAGE_CASES)
def test_bad_uploads_are_named_by_the_clients_file_name(server, files, case):
    uploaded = upload(server, files[case])
    event, data = call(server, "predict", [file_data(uploaded, orig_name=f"C:\\Users\\me\\{files[case].name}"),
                                           *CONTROLS])
    app_limit = IMAGE_CASES[case].replace("at most 64 megapixels", pixel_limit(uploads.APP_MAX_PIXELS))  # the app allows less than training
    assert_refused(server, event, data, f"{files[case].name} {app_limit}")


def test_a_bundled_example_as_the_page_loads_it_is_classified(server):
    """Clicking an example: the page calls load_example, then /predict with what it returned."""
    event, data = call(server, "load_example", [0])
    assert event == "complete", data
    example = data[0]["value"]
    assert Path(example["path"]).resolve().is_relative_to(upload_folder().resolve())
    event, data = call(server, "predict", [example, *CONTROLS])
    assert event == "complete" and data[0]["label"] == "7", data


@pytest.mark.parametrize("message, shown", [
    ("/tmp/gradio/3f2a/x.png is not a readable image", "x.png is not a readable image"),
    ("weights in '/srv/models/m/model.safetensors' do not match", "weights in 'model.safetensors' do not match"),
    ("C:\\Users\\me\\x.png is too large", "x.png is too large"),
    ("expected 3/4 of the ink, got 1x2 pixels", "expected 3/4 of the ink, got 1x2 pixels"),
])
def test_app_messages_keep_no_server_path(message, shown):
    """The app's last line of defence: whatever error reaches a user names files, not paths."""
    assert uploads.without_paths(message) == shown


@pytest.mark.parametrize("composite", [str(SERVER_FILE), {"path": str(SERVER_FILE)}], ids=["string", "file data"])
def test_the_drawing_handler_opens_no_path_itself(composite):
    """Gradio turns the sketchpad's files into PIL images; anything else is refused, not opened."""
    with pytest.raises(gr.Error) as error:
        uploads.read_drawing({"composite": composite}, (28, 28))
    assert_one_line(error.value.message, "expected the drawing as an image, got")
    assert str(SERVER_FILE) not in error.value.message


def refused_by_gradio_log(server_log: str) -> list[str]:
    """The lines the server logged for requests Gradio's own checks refused."""
    return [line for line in server_log.splitlines() if line.startswith("refused a request")]


@pytest.mark.parametrize("k, method", [(float("inf"), "rollout"), (float("-inf"), "rollout"), (3, {"rollout": 1})],
                         ids=["k=inf", "k=-inf", "dict-method"])
def test_a_drawing_request_gradio_refuses_is_one_line_in_the_server_log(server, k, method, capfd):
    """/explain_drawing's controls go through Gradio's own checks (its slider and dropdown) before
    the app's handler: a refusal there is one line in the log, no traceback."""
    capfd.readouterr()
    image = file_data(upload(server, SAMPLE), orig_name=SAMPLE.name)
    event, data = call(server, "explain_drawing", [{"background": None, "layers": [], "composite": image},
                                                   "mean", 0.0, k, method])
    assert event == "error", data
    log = capfd.readouterr().err
    assert "Traceback" not in log, log
    [line] = refused_by_gradio_log(log)
    assert_one_line(line.replace("refused a request", "expected a request", 1) + " (found)")


def test_only_a_refusal_that_never_reached_the_app_is_logged_in_one_line(capsys):
    """A failure inside vit_hub's code is a bug: the log keeps its traceback."""
    from vit_hub.model.config import ViTConfig

    logged = uploads.OneLineRefusals()
    try:
        raise ValueError("Value inf is greater than maximum value 10.\nsecond line")
    except ValueError:
        logged.print_exc()
    assert capsys.readouterr().err == "refused a request: ValueError: Value inf is greater than maximum value 10.\n"
    try:
        ViTConfig(depth="deep")
    except ValueError:
        logged.print_exc()
    assert "Traceback" in capsys.readouterr().err
