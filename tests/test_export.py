"""ONNX export and the torch-free ONNX Runtime classifier. Offline, CPU."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import tomllib
import torch
from PIL import Image
from torch import nn

from conftest import tiny_config, train_tiny
from vit_hub.export import (OnnxClassifier, ProviderFallbackError, VerificationError, ensure_graphs, export_onnx,
                            open_exporting)
from vit_hub import cli
from vit_hub.export.__main__ import main as cli_main
from vit_hub.export.exporter import write_graph
from vit_hub.export.session import CPU, CUDA, CUDA_OPTIONS
from vit_hub.export.verify import check_file
from vit_hub.errors import UserError
from vit_hub.hub.pretrained import HubVisionTransformer
from vit_hub.layout import GRAPH_INPUT, GRAPH_LOGITS, ExportLayout
from vit_hub.model.config import ViTConfig
from vit_hub.processing.postprocess import softmax, top_k

REPO = Path(__file__).resolve().parents[1]
BUNDLED_MODEL = REPO / "models" / "vit-mnist"
EXPORT_COMMANDS = {"python -m vit_hub.export": cli_main, "vit-hub export": lambda argv: cli.main(["export", *argv])}


# Weights that make the parity tests see how each GELU is computed. At the ViT init (std 0.02)
# GELU's arguments stay near 0, where its tanh approximation matches the exact erf form to
# 1e-6, so a graph that approximated it would pass a 1e-4 logits tolerance; with arguments of
# a few units the two differ by up to 5e-4 per value, and the head carries that to the logits.
MLP_WEIGHT_STD = 0.3
HEAD_WEIGHT_STD = 2.0


def randomized(model: HubVisionTransformer, seed: int = 0) -> HubVisionTransformer:
    """Non-zero head weights, so logits differ between images (the ViT init zeroes the head),
    and MLP weights large enough for the logits to show an approximated GELU (see above)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and ".mlp." in f".{name}.":
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * MLP_WEIGHT_STD)
        model.head.weight.copy_(torch.randn(model.head.weight.shape, generator=generator) * HEAD_WEIGHT_STD)
        model.head.bias.copy_(torch.randn(model.head.bias.shape, generator=generator) * 0.1)
    return model.eval()


def exact_gelus(graph: onnx.ModelProto) -> int:
    """How many GELUs the graph computes exactly: Erf nodes (the exporters' decomposition) and
    Gelu nodes without approximate="tanh"."""
    def approximation(node):
        return next((attribute.s.decode() for attribute in node.attribute if attribute.name == "approximate"), "none")

    return sum(node.op_type == "Erf" or node.op_type == "Gelu" and approximation(node) == "none"
               for node in graph.graph.node)


def pixels_for(config: ViTConfig, batch: int, seed: int = 0) -> np.ndarray:
    shape = (batch, config.in_channels, *config.image_size)  # [B, C, H, W]
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def torch_outputs(model: HubVisionTransformer, pixels: np.ndarray, output_attentions: bool = False):
    with torch.inference_mode():
        logits, weights = model(torch.from_numpy(pixels), output_attentions=output_attentions)
    return (logits.numpy(), torch.stack(weights).numpy()) if output_attentions else logits.numpy()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny RGB model dir (16x16, dim 16, depth 2) and the model itself."""
    model = randomized(HubVisionTransformer(**tiny_config()))
    folder = tmp_path_factory.mktemp("tiny_model")
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def exported(tiny, tmp_path_factory) -> Path:
    """The tiny model exported with its attentions graph; returns the logits graph path."""
    folder, _ = tiny
    return export_onnx(folder, tmp_path_factory.mktemp("onnx") / "model.onnx", output_attentions=True)


@pytest.fixture(scope="module")
def classifier(exported) -> OnnxClassifier:
    return OnnxClassifier(exported, providers="cpu")


# Export and verification ---------------------------------------------------------------
def test_export_writes_self_contained_verified_graphs_and_the_config(exported, tiny):
    folder = exported.parent
    assert sorted(path.name for path in folder.iterdir()) == [
        "config.json", "model.onnx", "model_attentions.onnx", "model_export_report.json", "pipeline.onnx",
        "pipeline_explain.onnx", "pipeline_map.onnx", "preprocess.onnx"]
    assert ViTConfig.from_json(folder / "config.json") == tiny[1].config
    report = json.loads((folder / "model_export_report.json").read_text())
    pipeline = report["pipeline"]["pipeline.onnx"]
    assert pipeline["uploads"] >= 12 and not pipeline["failures"] and pipeline["max_abs_diff"] <= 1e-4
    preprocessing = report["preprocess"]  # an RGB model's pixel values: within the float32 rounding of a resize
    assert preprocessing["uploads"] == pipeline["uploads"] and not preprocessing["failures"]
    assert report["exporter"] == "torchscript" and report["opset"] == 18
    for name, outputs in [("model.onnx", ["logits"]), ("model_attentions.onnx", ["logits", "attentions"])]:
        graph = report["graphs"][name]
        assert graph["passed"] and graph["checker"] == "passed" and graph["self_contained"]
        assert onnx.load(str(folder / name)).opset_import[0].version == 18
        assert graph["inputs"]["pixel_values"] == ["batch", 3, 16, 16]
        assert list(graph["outputs"]) == outputs
        assert {(row["input"], row["batch"]) for row in graph["parity"]} == {
            ("random", 1), ("random", 7), ("real", 1), ("real", 7)}
        assert all(row["logits_max_abs_diff"] <= 1e-4 for row in graph["parity"])
        proto = onnx.load(str(folder / name))
        assert exact_gelus(proto) == tiny[1].config.depth  # one per block's MLP, computed exactly
        assert "Tanh" not in {node.op_type for node in proto.graph.node}
    assert all(row["attentions_max_abs_diff"] <= 1e-5 for row in report["graphs"]["model_attentions.onnx"]["parity"])


def test_the_tiny_model_tells_exact_gelu_from_its_tanh_approximation(tiny, tmp_path):
    """The parity tests would miss a graph with GELU approximated by tanh if the tiny model did
    not make it visible: a graph so exported misses the logits tolerance by far."""
    approximated = copy.deepcopy(tiny[1])
    for module in approximated.modules():
        if isinstance(module, nn.GELU):
            module.approximate = "tanh"
    path = write_graph(approximated, tmp_path / "tanh_gelu.onnx", output_attentions=False)
    assert exact_gelus(onnx.load(str(path))) == 0
    pixels = pixels_for(tiny[1].config, 7)
    session = onnxruntime.InferenceSession(str(path), providers=[CPU])
    [logits] = session.run([GRAPH_LOGITS], {GRAPH_INPUT: pixels})
    assert np.abs(logits - torch_outputs(tiny[1], pixels)).max() > 5 * 1e-4  # 5x the tolerance


@pytest.mark.parametrize("batch", [1, 5])
def test_logits_match_torch_at_two_batch_sizes(classifier, tiny, batch):
    pixels = pixels_for(tiny[1].config, batch, seed=batch)
    logits = classifier.run(pixels)
    assert logits.shape == (batch, 2)
    np.testing.assert_allclose(logits, torch_outputs(tiny[1], pixels), atol=1e-4, rtol=0)


def test_attentions_equal_torch_output_attentions(classifier, tiny):
    pixels = pixels_for(tiny[1].config, 3, seed=1)
    logits, attentions = classifier.run(pixels, output_attentions=True)
    torch_logits, torch_attentions = torch_outputs(tiny[1], pixels, output_attentions=True)
    assert attentions.shape == (2, 3, 2, 17, 17)  # [depth, B, heads, T, T]
    np.testing.assert_allclose(attentions, torch_attentions, atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits, torch_logits, atol=1e-4, rtol=0)


def test_logits_graph_carries_no_attention_output(exported, classifier):
    assert [output.name for output in classifier.session.get_outputs()] == ["logits"]
    assert [output.name for output in onnx.load(str(exported)).graph.output] == ["logits"]
    assert classifier.can_output_attentions  # from model_attentions.onnx beside it


@pytest.mark.parametrize("pooling, patch_embedding", [("mean", "shifted"), ("cls", "shifted"), ("cls", "convstem")])
def test_non_square_small_data_model_exports_with_parity(tmp_path, pooling, patch_embedding):
    """Shifted patches or a conv stem, locality attention (masked), sin-cos positions, 16x24.
    cls pooling: the last block sees the class token alone."""
    model = randomized(HubVisionTransformer(**tiny_config(
        image_size=[16, 24], patch_embedding=patch_embedding, locality_attention=True, pos_embedding="sincos",
        pooling=pooling)))
    path = export_onnx(model, tmp_path / "small.onnx", output_attentions=True)
    classifier = OnnxClassifier(path, providers="cpu")
    pixels = pixels_for(model.config, 4)
    logits, attentions = classifier.run(pixels, output_attentions=True)
    torch_logits, torch_attentions = torch_outputs(model, pixels, output_attentions=True)
    np.testing.assert_allclose(logits, torch_logits, atol=1e-4, rtol=0)
    np.testing.assert_allclose(attentions, torch_attentions, atol=1e-5, rtol=0)
    assert np.all(np.diagonal(attentions, axis1=-2, axis2=-1) == 0)  # no token attends to itself


def test_a_gpu_servers_route_gives_an_rgb_model_the_python_paths_answers_batched(exported):
    """UploadClassifier (docs/export.md, "On a GPU server") on a photo model: photos of any size
    and mode, batched (two network runs) and one at a time, against preprocess + model.onnx."""
    from vit_hub.export.batched_runtime import BATCH_TOLERANCE, UploadClassifier
    from vit_hub.export.pipeline_graph import PROBABILITY_TOLERANCE, decoded_pixels
    from vit_hub.processing.preprocess import preprocess

    rng = np.random.default_rng(3)
    images = [Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA").convert(mode)
              for (height, width), mode in [((40, 50), "RGB"), ((16, 16), "RGB"), ((300, 200), "RGBA"), ((33, 17), "L"),
                                            ((90, 60), "LA")]]
    network = OnnxClassifier(exported, providers="cpu")
    with UploadClassifier(exported, providers="cpu", workers=2, batch_size=3) as server:
        batched = server.classify([decoded_pixels(image) for image in images])
        for answer, image in zip(batched, images):
            alone = server.classify([decoded_pixels(image)])[0]
            expected = softmax(network.run(preprocess(image, network.config)[None]), network.config.temperature)[0]
            np.testing.assert_allclose(answer.probabilities, alone.probabilities, atol=BATCH_TOLERANCE, rtol=0)
            np.testing.assert_allclose(answer.probabilities, expected, atol=PROBABILITY_TOLERANCE, rtol=0)


def test_dynamo_exporter_writes_one_file_with_a_dynamic_batch(tiny, tmp_path):
    path = export_onnx(tiny[1], tmp_path / "dynamo.onnx", exporter="dynamo")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json", "dynamo.onnx", "dynamo_export_report.json", "dynamo_pipeline.onnx", "dynamo_preprocess.onnx"]
    report = json.loads((tmp_path / "dynamo_export_report.json").read_text())
    assert report["exporter"] == "dynamo" and report["graphs"]["dynamo.onnx"]["passed"]
    assert isinstance(report["graphs"]["dynamo.onnx"]["inputs"]["pixel_values"][0], str)
    pixels = pixels_for(tiny[1].config, 7)
    np.testing.assert_allclose(OnnxClassifier(path, providers="cpu").run(pixels), torch_outputs(tiny[1], pixels),
                               atol=1e-4, rtol=0)


def test_written_opset_and_outputs_are_checked(exported):
    with pytest.raises(VerificationError, match="asked for opset 17, the file says 18"):
        check_file(exported, 17, ["logits"])
    with pytest.raises(VerificationError, match="expected input"):
        check_file(exported, 18, ["logits", "attentions"])


def test_export_into_the_model_dir_keeps_its_config_and_drops_stale_graphs(tiny, tmp_path):
    model_dir = tmp_path / "model"
    tiny[1].save_pretrained(model_dir)
    config_bytes = (model_dir / "config.json").read_bytes()
    export_onnx(model_dir, model_dir / "model.onnx", output_attentions=True)
    export_onnx(model_dir, model_dir)  # again, without attentions: the old attentions graph must go
    assert (model_dir / "config.json").read_bytes() == config_bytes
    assert (model_dir / "model.onnx").is_file() and not (model_dir / "model_attentions.onnx").exists()


@pytest.mark.parametrize("kwargs, message", [
    (dict(opset=25), "opsets 17-20"),
    (dict(exporter="dynamo", opset=17), "opsets 18-23"),
    (dict(exporter="jit"), "expected one of torchscript, dynamo"),
    (dict(quantize="int4"), "expected one of int8"),
    (dict(quantize="int8", eval_limit=0), "expected a positive number of images, got 0"),
])
def test_bad_export_options_are_one_clear_error(tiny, tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        export_onnx(tiny[0], tmp_path, **kwargs)


# The package ---------------------------------------------------------------------------
def test_export_installs_inside_the_vit_hub_namespace():
    """export/ installs as vit_hub.export (a top-level `export` would collide in a user's
    environment), and the wheel's explicit package list names every subpackage of vit_hub, and
    the bundled model's folder as data (vit_hub/bundled/model)."""
    settings = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert settings["package-dir"] == {"vit_hub.export": "export", "vit_hub.bundled.model": "models/vit-mnist"}
    subpackages = {".".join(init.parent.relative_to(REPO).parts) for init in (REPO / "vit_hub").rglob("__init__.py")}
    assert sorted(settings["packages"]) == sorted(subpackages | {"vit_hub.export", "vit_hub.bundled.model"})
    import vit_hub.export

    assert Path(vit_hub.export.__file__).parent == REPO / "export"


def test_export_imports_from_a_checkout_without_the_editable_install():
    """After a plain `pip install .`, `python app.py` in the checkout imports the checkout's
    vit_hub, which no install maps export/ into: the package finds the folder itself."""
    script = ("import sys\n"
              "sys.meta_path[:] = [finder for finder in sys.meta_path if 'editable' not in getattr(finder, '__module__', '')]\n"
              "from vit_hub.export import OnnxClassifier\nfrom vit_hub.export import runtime\n"
              "print(runtime.__file__, OnnxClassifier.__module__)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(REPO / "export" / "runtime.py"), "vit_hub.export.runtime"]



def test_a_second_checkout_runs_its_own_export_code(tmp_path):
    """With this checkout installed editable, another clone first on the path imports its own
    vit_hub *and* its own export/: edits there must not silently run this checkout's code."""
    clone = tmp_path / "clone"
    shutil.copytree(REPO / "vit_hub", clone / "vit_hub", ignore=shutil.ignore_patterns("bundled", "__pycache__"))
    shutil.copytree(REPO / "export", clone / "export", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", clone)
    script = "import vit_hub, vit_hub.export.runtime as runtime; print(vit_hub.__file__); print(runtime.__file__)"
    environment = {**os.environ, "PYTHONPATH": str(clone)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=clone,
                            env=environment, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(clone / "vit_hub" / "__init__.py"), str(clone / "export" / "runtime.py")]


# The runtime ---------------------------------------------------------------------------
BLOCK_TORCH = """
import sys
class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "torchvision"):
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, BlockTorch())
"""


def test_runtime_works_where_torch_cannot_be_imported(exported, tmp_path):
    image = tmp_path / "image.png"
    Image.new("RGB", (40, 30), (200, 60, 20)).save(image)
    script = BLOCK_TORCH + textwrap.dedent(f"""
        import numpy as np
        from vit_hub.export import OnnxClassifier
        classifier = OnnxClassifier({str(exported)!r})
        ranked = classifier.predict({str(image)!r}, top_k=2)
        logits, attentions = classifier.run(classifier.preprocess([{str(image)!r}]), output_attentions=True)
        assert sorted(label for label, _ in ranked) == ["bright_disc", "dark_square"] and ranked[0][1] >= ranked[1][1]
        assert attentions.shape == (2, 1, 2, 17, 17), attentions.shape
        assert not any(name.split(".")[0] in ("torch", "torchvision") for name in sys.modules)
        print("torch-free:", classifier.providers)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    # "auto" runs on CUDA wherever asking for CUDA by name works (a GPU machine), else on the CPU.
    expected = [CUDA, CPU] if _cuda_works(exported) else [CPU]
    assert f"torch-free: {expected}" in result.stdout


EXPORTER_MODULES = ("pipeline", "exporter", "verify", "evalset", "half", "quantize")


def test_the_runtime_imports_neither_torch_nor_the_exporter(exported):
    """The runtime serves models that ship their graphs; exporting them (torch) is the caller's
    business (on_demand.py), so neither loads while a classifier opens and runs."""
    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        from vit_hub.export import OnnxClassifier, open_exporting
        classifier = OnnxClassifier.from_model({str(exported.parent)!r}, output_attentions=True, providers="cpu")
        classifier.run(np.zeros((1, 3, 16, 16), np.float32), output_attentions=True)
        open_exporting({str(exported.parent)!r}, export_dir=None, output_attentions=True, providers="cpu")
        print(sorted(name for name in sys.modules if name.split(".")[0] in ("torch", "torchvision")
                     or name.startswith("vit_hub.export.") and name.rsplit(".", 1)[1] in {EXPORTER_MODULES!r}))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_the_caller_exports_on_the_fly_into_a_folder_it_names(tiny, exported, tmp_path):
    model_dir = tiny[0]  # the weights and config only
    with pytest.raises(FileNotFoundError, match=r"expected model_attentions.onnx in .*python -m vit_hub.export"):
        OnnxClassifier.from_model(model_dir, output_attentions=True)
    asked = []

    def export_dir(folder: Path) -> Path:
        asked.append(folder)
        return tmp_path / "graphs"

    classifier = open_exporting(model_dir, export_dir=export_dir, output_attentions=True, providers="cpu")
    assert asked == [model_dir] and classifier.model_path == tmp_path / "graphs" / "model.onnx"
    assert classifier.model_dir == model_dir and classifier.can_output_attentions
    assert ensure_graphs(exported.parent, export_dir=export_dir, output_attentions=True) == exported.parent
    assert asked == [model_dir]  # graphs there: nothing exported


def _cuda_works(exported) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return OnnxClassifier(exported, providers="cuda").providers[0] == CUDA


def test_asking_for_cuda_without_a_gpu_warns_once_and_runs_on_cpu(exported, capfd):
    if _cuda_works(exported):
        pytest.skip("the CUDA provider works on this machine: there is no fallback to report")
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        classifier = OnnxClassifier(exported, providers="cuda")
    assert classifier.providers == [CPU]
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "CUDAExecutionProvider was requested" in messages[0]
    assert "running on CPUExecutionProvider" in messages[0]
    assert "onnxruntime" not in capfd.readouterr().err  # onnxruntime's own log lines are not repeated


def test_strict_cuda_request_raises_instead_of_falling_back(exported):
    if _cuda_works(exported):
        pytest.skip("the CUDA provider works on this machine: there is no fallback to refuse")
    with pytest.raises(ProviderFallbackError, match="CUDAExecutionProvider was requested"):
        OnnxClassifier(exported, providers="cuda", strict=True)


def test_auto_and_cpu_providers_run_without_warnings(exported):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto = OnnxClassifier(exported)  # "auto"
        cpu = OnnxClassifier(exported, providers=[CPU], strict=True)
    assert auto.providers[0] in (CUDA, CPU) and cpu.providers == [CPU]


@pytest.fixture
def gpu_like(monkeypatch):
    """onnxruntime as on a GPU machine: CUDA available and able to start. Sessions are still
    created on the CPU; returns the provider lists handed to onnxruntime, in order."""
    from vit_hub.export import runtime, session

    handed, real_session = [], session._session

    def recording(path, options, providers):
        handed.append(providers)
        return real_session(path, options, [CPU])

    monkeypatch.setattr(session.ort, "get_available_providers", lambda: [CUDA, CPU])
    monkeypatch.setattr(session, "cuda_can_start", lambda: True)
    monkeypatch.setattr(runtime, "cuda_can_start", lambda: True)
    monkeypatch.setattr(session.ort, "preload_dlls", lambda: None)
    monkeypatch.setattr(session, "_session", recording)
    return handed


def test_exact_turns_tf32_off_in_the_cuda_provider(exported, gpu_like):
    """TF32 puts ORT CUDA's logits ~1e-3 from torch fp32; exact=True asks CUDA for full fp32."""
    OnnxClassifier(exported, exact=True)
    OnnxClassifier(exported)
    (exact_name, exact_options), *exact_rest = gpu_like[0]
    (default_name, default_options), *_ = gpu_like[1]
    assert exact_name == default_name == CUDA and exact_rest == [CPU]
    assert exact_options["use_tf32"] == "0" and "use_tf32" not in default_options


def test_export_verifies_exactly_on_the_provider_auto_picks(tiny, tmp_path, gpu_like):
    export_onnx(tiny[1], tmp_path)
    assert gpu_like and all(providers[0] == (CUDA, {**CUDA_OPTIONS, "use_tf32": "0"}) for providers in gpu_like)
    report = json.loads((tmp_path / "model_export_report.json").read_text())
    assert {row["provider"] for row in report["graphs"]["model.onnx"]["parity"]} == {CPU}  # what ran here


def test_io_binding_gives_the_same_outputs(exported, classifier, tiny):
    bound = OnnxClassifier(exported, providers="cpu", io_binding=True)
    pixels = pixels_for(tiny[1].config, 3, seed=2)
    np.testing.assert_array_equal(bound.run(pixels), classifier.run(pixels))
    for ours, theirs in zip(bound.run(pixels, output_attentions=True), classifier.run(pixels, output_attentions=True)):
        np.testing.assert_array_equal(ours, theirs)


def test_predict_takes_paths_pil_images_and_arrays(classifier, tmp_path):
    path = tmp_path / "square.jpg"
    Image.new("RGB", (48, 32), (30, 40, 70)).save(path)
    single = classifier.predict(path, top_k=2)
    assert {label for label, _ in single} == {"bright_disc", "dark_square"}
    assert single[0][1] >= single[1][1] and abs(sum(p for _, p in single) - 1) < 1e-5
    batch = classifier.predict([str(path), Image.open(path), np.asarray(Image.open(path))], top_k=1)
    assert len(batch) == 3 and all(len(ranked) == 1 for ranked in batch)
    assert batch[0] == batch[1] and batch[0][0][0] == single[0][0]


def test_softmax_and_top_k_are_torch_free_and_ranked():
    probabilities = softmax(np.array([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]], dtype=np.float32))
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-6)
    assert [label for label, _ in top_k(probabilities, ["a", "b", "c"], 2)[0]] == ["b", "c"]
    assert top_k(probabilities, ["a", "b", "c"], 9)[1][0][0] == "c"


@pytest.mark.parametrize("pixels, error, message", [
    (np.zeros((3, 16, 16), np.float32), ValueError, r"rank 4 \[batch, 3, 16, 16\], got rank 3"),
    (np.zeros((1, 1, 16, 16), np.float32), ValueError, "expected 3 input channels .* got 1"),
    (np.zeros((1, 3, 28, 28), np.float32), ValueError, "expected images of 16x16 pixels .* got 28x28"),
    (np.zeros((1, 3, 16, 16), np.uint8), ValueError, "expected float pixel_values .* got dtype uint8"),
    (np.zeros((0, 3, 16, 16), np.float32), ValueError, "got batch size 0"),
    ([[0.0]], TypeError, "expected pixel_values as a NumPy array"),
])
def test_bad_pixel_values_are_one_clear_error(classifier, pixels, error, message):
    with pytest.raises(error, match=message):
        classifier.run(pixels)


def test_bad_images_are_one_clear_error(classifier, tmp_path):
    with pytest.raises(ValueError, match="got dtype int64"):
        classifier.predict(np.zeros((20, 20), np.int64))
    with pytest.raises(FileNotFoundError, match="expected an image file"):
        classifier.predict(tmp_path / "missing.png")
    with pytest.raises(ValueError, match="empty list"):
        classifier.predict([])


def test_missing_or_mismatched_files_are_one_clear_error(exported, tmp_path):
    lone = tmp_path / "lone" / "model.onnx"
    lone.parent.mkdir()
    lone.write_bytes(exported.read_bytes())
    with pytest.raises(FileNotFoundError, match="expected a vit_hub config.json at .*lone/config.json"):
        OnnxClassifier(lone)
    with pytest.raises(FileNotFoundError, match="expected an ONNX model at"):
        OnnxClassifier(tmp_path / "nothing.onnx")
    assert OnnxClassifier(lone, config_path=exported.parent / "config.json", providers="cpu").config.num_classes == 2
    with pytest.raises(ValueError, match=r"model_attentions.onnx does not exist.*--output-attentions"):
        OnnxClassifier(lone, config_path=exported.parent / "config.json", providers="cpu").run(
            np.zeros((1, 3, 16, 16), np.float32), output_attentions=True)
    other = tmp_path / "other.json"
    other.write_text(json.dumps(tiny_config(image_size=32)))
    with pytest.raises(ValueError, match=r"takes images of shape \[3, 16, 16\] but its config says \[3, 32, 32\]"):
        OnnxClassifier(lone, config_path=other)
    with pytest.raises(ValueError, match="providers: expected 'auto', 'cpu', 'cuda'"):
        OnnxClassifier(exported, providers="tpu")


# Half precision (the GPU speed is measured only on a GPU; here: the graph, its checks, the choice) ---
@pytest.fixture(scope="module")
def exported_fp16(trained_tiny_dir, split_image_folder, tmp_path_factory) -> Path:
    return export_onnx(trained_tiny_dir, tmp_path_factory.mktemp("fp16"), output_attentions=True, precision="fp16",
                       calib_data=str(split_image_folder))


def test_fp16_export_writes_verified_float16_copies_with_float32_io(exported_fp16):
    folder = exported_fp16.parent
    report = json.loads((folder / "model_export_report.json").read_text())
    for name, outputs in (("model_fp16.onnx", ["logits"]), ("model_attentions_fp16.onnx", ["logits", "attentions"])):
        graph = onnx.load(folder / name)
        assert [value.name for value in graph.graph.output] == outputs
        assert {value.type.tensor_type.elem_type for value in [*graph.graph.input, *graph.graph.output]} == {
            onnx.TensorProto.FLOAT}  # callers pass and get float32, as with the fp32 graph
        assert any(tensor.data_type == onnx.TensorProto.FLOAT16 for tensor in graph.graph.initializer)
        assert not any(tensor.data_type == onnx.TensorProto.FLOAT for tensor in graph.graph.initializer
                       if len(tensor.dims) > 1)  # every weight matrix is half
        assert report["graphs"][name]["passed"] and report["graphs"][name]["tolerances_max_abs_diff"]["logits"] == 5e-2
    half = report["fp16"]
    assert half["n"] == 16 and half["top1_agreement"] == 100.0 and 0 < half["logits_max_abs_diff_vs_fp32"] < 5e-2
    # The logits copy is ONNX Runtime's fused form (fused_graph.py); the attentions copy keeps
    # the weights rollout reads, so its attention stays in standard operators.
    depth = json.loads((folder / "config.json").read_text())["depth"]
    assert report["graphs"]["model_fp16.onnx"]["onnxruntime_operators"] == {
        "BiasGelu": depth, "MultiHeadAttention": depth, "SkipLayerNormalization": 2 * depth}
    assert report["graphs"]["model_attentions_fp16.onnx"]["onnxruntime_operators"] == {}


def test_fp16_parity_failure_fails_the_export(trained_tiny_dir, tmp_path, monkeypatch):
    from vit_hub.export import half

    monkeypatch.setitem(half.FP16_TOLERANCES, "logits", 1e-9)  # no float16 graph is this close
    with pytest.raises(VerificationError, match=r"logits differ by .* > 1e-09"):
        export_onnx(trained_tiny_dir, tmp_path, precision="fp16")


def test_export_without_fp16_removes_stale_copies(exported_fp16, trained_tiny_dir, tmp_path):
    for name in ("model_fp16.onnx", "model_attentions_fp16.onnx"):
        (tmp_path / name).write_bytes((exported_fp16.parent / name).read_bytes())
    export_onnx(trained_tiny_dir, tmp_path)
    assert not (tmp_path / "model_fp16.onnx").exists() and not (tmp_path / "model_attentions_fp16.onnx").exists()


@pytest.mark.parametrize("precision, providers, cuda_starts, exported_fp16, chosen", [
    ("auto", [(CUDA, {}), CPU], True, True, "fp16"),    # CUDA runs it and the copy exists
    ("auto", [(CUDA, {}), CPU], True, False, "fp32"),   # no copy exported
    ("auto", [(CUDA, {}), CPU], False, True, "fp32"),   # CUDA cannot start: the CPU runs fp32 faster
    ("auto", [CPU], True, True, "fp32"),
    ("fp16", [CPU], False, True, "fp16"),               # asked for by name
    ("fp32", [(CUDA, {}), CPU], True, True, "fp32"),
])
def test_precision_choice_with_faked_providers(precision, providers, cuda_starts, exported_fp16, chosen):
    from vit_hub.export.session import choose_precision

    assert choose_precision(precision, providers, cuda_starts, exported_fp16) == chosen


def test_auto_loads_the_fp16_copy_for_cuda_and_fp32_when_cuda_does_not_start(exported_fp16, monkeypatch):
    """On a 'GPU machine' whose CUDA provider then fails to start, auto tries model_fp16.onnx
    on CUDA, sees the session on the CPU and reloads model.onnx."""
    from vit_hub.export import runtime, session

    loaded, real_session = [], session._session
    monkeypatch.setattr(session.ort, "get_available_providers", lambda: [CUDA, CPU])
    monkeypatch.setattr(session, "cuda_can_start", lambda: True)
    monkeypatch.setattr(runtime, "cuda_can_start", lambda: True)
    monkeypatch.setattr(session.ort, "preload_dlls", lambda: None)
    monkeypatch.setattr(session, "_session", lambda path, options, providers: (
        loaded.append((Path(path).name, session.provider_name(providers[0]))), real_session(path, options, [CPU]))[1])
    classifier = OnnxClassifier(exported_fp16)
    assert loaded == [("model_fp16.onnx", CUDA), ("model.onnx", CUDA)] and classifier.precision == "fp32"


def test_fp16_by_name_runs_on_the_cpu_and_agrees(exported_fp16, split_image_folder):
    half = OnnxClassifier(exported_fp16, providers="cpu", precision="fp16")
    full = OnnxClassifier(exported_fp16, providers="cpu")
    assert (half.precision, full.precision) == ("fp16", "fp32")  # auto on the CPU: fp32
    pixels = half.preprocess(sorted((split_image_folder / "test" / "dark_square").iterdir()))
    np.testing.assert_allclose(half.run(pixels), full.run(pixels), atol=5e-2)
    (_, half_attentions), (_, full_attentions) = (half.run(pixels, output_attentions=True),
                                                            full.run(pixels, output_attentions=True))
    np.testing.assert_allclose(half_attentions, full_attentions, atol=5e-3)
    assert half._attentions is not None and half.layout.in_precision(half.layout.attentions, "fp16").is_file()


def test_fp16_asked_for_without_the_copy_names_the_export_command(exported):
    with pytest.raises(FileNotFoundError, match=r"model_fp16.onnx beside model.onnx, found none.*--precision fp16"):
        OnnxClassifier(exported, precision="fp16")
    with pytest.raises(ValueError, match=r"precision: expected 'auto', 'fp32', 'fp16', got 'int4'"):
        OnnxClassifier(exported, precision="int4")


def test_cli_fp16_summary_line_and_bad_precision(exported_fp16, capsys):
    from vit_hub.export.__main__ import summary

    lines = summary(json.loads((exported_fp16.parent / "model_export_report.json").read_text()))
    assert any(line.startswith("model_attentions_fp16.onnx: ") for line in lines)
    assert any(line.startswith("fp16: top-1 agreement with fp32 100.00% on 16 images") for line in lines)
    with pytest.raises(SystemExit):
        cli_main(["--model", "m", "--out", "o", "--precision", "int4"])
    assert "argument --precision: invalid choice: 'int4'" in capsys.readouterr().err


# Quantization --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained_tiny_dir(split_image_folder, tmp_path_factory) -> Path:
    return train_tiny(split_image_folder, tmp_path_factory.mktemp("trained_tiny") / "model")


def test_int8_keeps_accuracy_on_a_small_set(trained_tiny_dir, split_image_folder, tmp_path):
    path = export_onnx(trained_tiny_dir, tmp_path, quantize="int8", calib_data=str(split_image_folder))
    layout = ExportLayout.for_model(path)
    report = json.loads(layout.report.read_text())
    accuracy = report["quantization"]["accuracy"]
    assert accuracy["n"] == 16 and accuracy["accuracy_fp32"] >= 90.0
    assert accuracy["within_bound"] and accuracy["top1_agreement"] == 100.0
    assert {row["batch"] for row in report["quantization"]["speed"]["per_call"]} == {1, 256}
    assert report["graphs"]["model_int8.onnx"]["checker"] == "passed"
    int8 = OnnxClassifier(layout.int8, providers="cpu")
    # The weights are stored as 8-bit integers (file size alone proves nothing for a model
    # this small: the quantize/scale nodes outweigh the bytes saved).
    float_bytes = {graph: sum(len(tensor.raw_data) for tensor in onnx.load(graph).graph.initializer
                              if tensor.data_type == onnx.TensorProto.FLOAT) for graph in (path, layout.int8)}
    assert any(tensor.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)
               for tensor in onnx.load(layout.int8).graph.initializer)
    assert float_bytes[layout.int8] < float_bytes[path] / 2
    images = sorted((split_image_folder / "test" / "dark_square").iterdir())[:4]
    assert [r[0][0] for r in int8.predict(images, top_k=1)] == ["dark_square"] * 4


def test_int8_needs_data_with_the_models_labels(tiny, tmp_path):
    with pytest.raises(ValueError, match="do not match the model's"):
        export_onnx(tiny[0], tmp_path, quantize="int8")  # tiny's labels are not MNIST digits


def test_bundled_model_exports_with_parity_and_int8_within_bound(tmp_path):
    path = export_onnx(BUNDLED_MODEL, tmp_path, quantize="int8", calib_data="mnist", eval_limit=1000)
    report = json.loads(ExportLayout.for_model(path).report.read_text())
    assert report["graphs"]["model.onnx"]["passed"]  # parity with torch on random and MNIST inputs
    accuracy = report["quantization"]["accuracy"]
    assert accuracy["accuracy_fp32"] >= 99.0  # a regression in the bundled model or its preprocessing fails here
    assert accuracy["accuracy_drop_points"] <= 0.3


# Command line --------------------------------------------------------------------------
def test_cli_exports_quantizes_and_prints_a_summary(trained_tiny_dir, split_image_folder, tmp_path):
    out = tmp_path / "cli" / "tiny.onnx"
    result = subprocess.run(
        [sys.executable, "-m", "vit_hub.export", "--model", str(trained_tiny_dir), "--out", str(out), "--output-attentions",
         "--quantize", "int8", "--calib-data", str(split_image_folder), "--opset", "17"],
        capture_output=True, text=True, cwd=REPO, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "config.json", "tiny.onnx", "tiny_attentions.onnx", "tiny_export_report.json", "tiny_int8.onnx",
        "tiny_pipeline.onnx", "tiny_pipeline_explain.onnx", "tiny_pipeline_map.onnx",
        "tiny_preprocess.onnx"]
    assert "tiny.onnx: " in result.stdout and "opset 17" in result.stdout and "int8: accuracy" in result.stdout
    assert "tiny_pipeline.onnx: the Python path's label on" in result.stdout
    assert "tiny_pipeline_map.onnx: the Python path's label on" in result.stdout and "rollout map max|diff|" in result.stdout
    assert "tiny_pipeline_explain.onnx: the Python path's label on" in result.stdout
    assert "integrated_gradients map max|diff|" in result.stdout  # a model never measured opens with it
    assert "tiny_preprocess.onnx: the Python path's pixel values on" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == (f"wrote {out.parent}/: tiny.onnx, tiny_attentions.onnx, "
                                                      f"tiny_pipeline.onnx, tiny_pipeline_map.onnx, tiny_pipeline_explain.onnx, "
                                                      f"tiny_preprocess.onnx, "
                                                      f"tiny_int8.onnx, config.json, tiny_export_report.json")
    assert "created" not in json.loads((out.parent / "tiny_export_report.json").read_text())  # same on every run


@pytest.mark.parametrize("argv, message", [
    (["--model", "/no/such/model", "--out", "x"], "--model"),
    (["--opset", "99"], "opsets 17-20"),
    (["--quantize", "int8"], "do not match the model's"),
])
@pytest.mark.parametrize("command", ["python -m vit_hub.export", "vit-hub export"])
def test_cli_errors_are_one_line_with_exit_code_2(tiny, tmp_path, capsys, monkeypatch, argv, message, command):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base = ["--model", str(tiny[0]), "--out", str(tmp_path / "out")]
    assert EXPORT_COMMANDS[command](base + argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    assert "Traceback" not in captured.err


def test_vit_hub_export_is_the_same_export_with_the_same_exit_codes(tiny, tmp_path, capsys, monkeypatch):
    """`vit-hub export` writes what `python -m vit_hub.export` writes and prints the same
    summary; a graph that fails verification exits 1 from both."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    printed = {}
    for command, main in EXPORT_COMMANDS.items():
        out = tmp_path / command.split()[0]
        assert main(["--model", str(tiny[0]), "--out", str(out)]) == 0
        printed[command] = capsys.readouterr().out.replace(str(out), "OUT")
        assert (out / "model.onnx").is_file() and (out / "pipeline.onnx").is_file()
    assert printed["vit-hub export"] == printed["python -m vit_hub.export"]
    assert printed["vit-hub export"].strip().splitlines()[-1].startswith("wrote OUT/: model.onnx")

    def failing(*args, **kwargs):
        raise VerificationError("logits differ by 1 > 1e-05")

    monkeypatch.setattr("vit_hub.export.export_model.export_onnx", failing)  # imported when the export runs
    for main in EXPORT_COMMANDS.values():
        assert main(["--model", str(tiny[0]), "--out", str(tmp_path / "failed")]) == 1
        assert capsys.readouterr().err == "error: logits differ by 1 > 1e-05\n"


@pytest.mark.parametrize("command", EXPORT_COMMANDS)
def test_every_export_flag_reaches_the_export_as_given(tmp_path, monkeypatch, command):
    """Both export commands hand each flag to export_onnx as given: --exporter dynamo exports with
    dynamo, not the default, and so on for every other flag."""
    from vit_hub.export import __main__ as export_main
    from vit_hub.export import export_model

    given = {}

    def recording(model, out, **options):
        given.update(model=model, out=out, **options)
        raise UserError("recorded, not exported")

    monkeypatch.setattr(export_model, "export_onnx", recording)
    monkeypatch.setattr(export_main, "export_onnx", recording, raising=False)  # where it is imported at the top
    out = str(tmp_path / "out")
    argv = ["--model", str(BUNDLED_MODEL), "--out", out, "--opset", "19", "--output-attentions", "--exporter",
            "dynamo", "--quantize", "int8", "--calib-data", "DATA", "--data-root", "ROOT", "--eval-limit", "5",
            "--precision", "fp16"]
    assert EXPORT_COMMANDS[command](argv) == 2
    assert given == dict(model=str(BUNDLED_MODEL), out=out, opset=19, output_attentions=True, exporter="dynamo",
                         quantize="int8", calib_data="DATA", data_root="ROOT", eval_limit=5, precision="fp16")


def test_a_photo_model_is_checked_on_its_own_samples_not_on_digits(tiny, tmp_path):
    """No --calib-data: an RGB model of photos is checked on the samples/ its model dir keeps;
    with none, the MNIST digits it is still checked on are said not to be its kind of image,
    and int8 accuracy (which needs labelled images of its classes) asks for --calib-data."""
    from vit_hub.data.samples import write_samples

    shutil.copytree(tiny[0], tmp_path / "photos")
    bare = export_onnx(tiny[0], tmp_path / "bare")
    real_input = json.loads(ExportLayout.for_model(bare).report.read_text())["parity"]["real_input"]
    assert "mnist (bundled)" in real_input and "not the model's kind of image" in real_input

    rng = np.random.default_rng(0)
    photos = [(Image.fromarray(rng.integers(0, 255, (20, 30, 3), dtype=np.uint8)), index % 2) for index in range(9)]
    write_samples(photos, tiny[1].config.labels, tmp_path / "photos")
    own = export_onnx(tmp_path / "photos", tmp_path / "own")
    report = json.loads(ExportLayout.for_model(own).report.read_text())
    assert report["parity"]["real_input"] == "first 7 images of the model's 9 sample images (samples/)"
    assert report["pipeline"]["pipeline.onnx"]["failures"] == []  # checked on uploads made of those samples
    with pytest.raises(UserError, match="the labels of the model's 9 sample images .* pass --calib-data"):
        export_onnx(tmp_path / "photos", tmp_path / "int8", quantize="int8")


def test_out_must_be_a_folder_or_an_onnx_path(tiny, tmp_path):
    existing = tmp_path / "notes.txt"
    existing.write_text("not a folder")
    with pytest.raises(NotADirectoryError, match="expected a folder or a path ending in .onnx"):
        export_onnx(tiny[0], existing)
