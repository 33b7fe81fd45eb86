"""A GPU server's route (export/batched_runtime.py, export/preprocess_graph.py): uploads
preprocessed on the CPU provider, the network once per batch; a batch gets the answers of one
upload at a time and the Python app's, refused uploads their reason; the preprocessing stays
on the CPU provider, and every node of the graphs meant for CUDA has a CUDA kernel for its
types in onnxruntime 1.31 (a table from its docs/OperatorKernels.md, below)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper
from PIL import Image

from conftest import assert_one_line, digit_on_paper
from vit_hub.export import batched_runtime, preprocess_graph, session
from vit_hub.export.batched_runtime import BATCH_TOLERANCE, UploadClassifier, decoded_upload
from vit_hub.export.pipeline_graph import (TOO_LARGE, TOO_SMALL, WRONG_CHANNELS, decoded_pixels, pipeline_session,
                                           preprocessing_graph, verification_uploads)
from vit_hub.export.preprocess_graph import EXECUTION_PROVIDER, preprocessing_model, preprocessing_session
from vit_hub.export.runtime import OnnxClassifier
from vit_hub.export.session import CPU, CUDA
from vit_hub.layout import (GRAPH_INPUT, PIPELINE_INPUT, PIPELINE_MAP, PIPELINE_OUTPUT, PIPELINE_ROLLOUT,
                            ExportLayout)
from vit_hub.errors import UserError
from vit_hub.model.config import ViTConfig
from vit_hub.processing.canonical import BLANK_IMAGE, NEARLY_BLANK, EmptyImageError
from vit_hub.processing.postprocess import softmax
from vit_hub.processing.preprocess import preprocess

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "vit-mnist"
LAYOUT = ExportLayout.for_model(MODEL_DIR)
SAMPLES = sorted((ROOT / "vit_hub" / "bundled" / "samples").glob("mnist_test_*_label_*.png"))


@pytest.fixture(scope="module")
def server():
    with UploadClassifier(MODEL_DIR, providers="cpu", workers=2, batch_size=5) as classifier:
        yield classifier


@pytest.fixture(scope="module")
def uploads(server):
    """Generated uploads as people send them: digits as they are, photographed on paper, drawn
    thin on a transparent canvas, with an alpha channel, and one on lit paper."""
    images = [Image.open(path) for path in SAMPLES[:3]]
    made = [image for _, image in verification_uploads(images, server.config)] + [digit_on_paper(SAMPLES[3])]
    return [decoded_upload(image) for image in made], made


def labels(answers) -> list[int | str]:
    """Each answer's label index, or its refusal."""
    return [answer.refusal or int(answer.probabilities.argmax()) for answer in answers]


def test_a_batch_gets_the_answers_of_one_upload_at_a_time(server, uploads):
    pixels, _ = uploads
    batched = server.classify(pixels)  # 13 uploads, one refused (no ink): three network runs of at most 5
    alone = [server.classify([upload])[0] for upload in pixels]
    assert labels(batched) == labels(alone) and sum(answer.refusal is None for answer in batched) == 12
    for together, single in zip(batched, alone):
        if together.refusal is None:
            np.testing.assert_allclose(together.probabilities, single.probabilities, atol=BATCH_TOLERANCE, rtol=0)


def test_the_answers_are_the_python_apps(server, uploads):
    pixels, images = uploads
    network = OnnxClassifier(MODEL_DIR, providers="cpu")
    for answer, image in zip(server.classify(pixels), images):
        try:
            pixel_values = preprocess(image, server.config)[None]
        except EmptyImageError as refused:
            assert answer.refusal == str(refused)
            continue
        expected = softmax(network.run(pixel_values), server.config.temperature)[0]
        assert int(answer.probabilities.argmax()) == int(expected.argmax())
        np.testing.assert_allclose(answer.probabilities, expected, atol=BATCH_TOLERANCE, rtol=0)


def test_a_refused_upload_gets_its_reason_and_the_others_their_answers(server, uploads):
    pixels, _ = uploads
    refused = [np.full((40, 40, 1), 200, np.uint8), np.zeros((1, 40, 3), np.uint8), np.zeros((40, 40, 5), np.uint8)]
    answers = server.classify([pixels[0], *refused, pixels[1]])
    assert [answer.refusal for answer in answers] == [None, BLANK_IMAGE, TOO_SMALL, WRONG_CHANNELS, None]
    assert labels([answers[0], answers[-1]]) == labels(server.classify([pixels[0], pixels[1]]))
    with pytest.raises(batched_runtime.UploadRefused, match="no ink"):
        server.top_k(answers[1])
    assert server.top_k(answers[0], 2)[0][0] in server.config.labels


def test_a_lone_dark_pixel_on_white_is_refused_as_nearly_blank(server):
    """The digit model answered "0" at 0.975 for one dark pixel on 300x300 white: now refused,
    as the Python path refuses it."""
    pixels = np.full((300, 300, 3), 255, np.uint8)
    pixels[150, 150] = 0
    (answer,) = server.classify([pixels])
    assert answer.probabilities is None and answer.refusal == NEARLY_BLANK


def test_an_upload_over_16_megapixels_is_refused_by_name(server):
    """The graph's own check (the largest upload pipeline.onnx takes), one pixel row over it."""
    answers = server.classify([np.zeros((4001, 4000, 1), np.uint8), np.zeros((4000, 4000, 1), np.uint8)])
    assert [answer.refusal for answer in answers] == [TOO_LARGE, BLANK_IMAGE]


@pytest.mark.parametrize("workers, batch_size", [(0, 5), (2, 0), (2, -1)])
def test_no_worker_or_an_empty_batch_is_refused_in_one_line(workers, batch_size):
    with pytest.raises(UserError) as refused:
        UploadClassifier(MODEL_DIR, providers="cpu", workers=workers, batch_size=batch_size)
    assert_one_line(str(refused.value), "workers and batch_size: expected at least 1", f"{workers} and {batch_size}")


@pytest.mark.parametrize("cores, workers, threads", [(8, 2, 4), (8, 3, 2), (8, 8, 1), (2, 4, 1), (8, 1, 0)],
                         ids=["two workers", "three workers", "one core each", "more workers than cores",
                              "one worker: onnxruntime's own choice"])
def test_each_worker_gets_its_share_of_the_cores(monkeypatch, cores, workers, threads):
    """Uploads preprocessed at once each get cores // workers of onnxruntime's threads, so
    together they never ask for more threads than cores; one worker gets onnxruntime's default
    (0), as pipeline.onnx does. The preprocessing keeps no CPU arena, which would hold the most
    a 16-megapixel upload took for good."""
    monkeypatch.setattr(batched_runtime, "available_cores", lambda: cores)
    with UploadClassifier(MODEL_DIR, providers="cpu", workers=workers) as classifier:
        options = classifier._preprocessing.get_session_options()
        assert (classifier.workers, options.intra_op_num_threads) == (workers, threads)
        assert not options.enable_cpu_mem_arena


@pytest.mark.parametrize("workers", [1, 2], ids=["one worker", "two workers"])
def test_no_session_of_the_route_spins_while_it_waits(workers):
    """onnxruntime's idle threads spin on a core by default: the network's, between batches, took
    a third of the CPU time per upload while the workers preprocessed, and with one worker the
    preprocessing's second thread as much as the first. Both sessions sleep instead; a plain
    OnnxClassifier keeps onnxruntime's default."""
    with UploadClassifier(MODEL_DIR, providers="cpu", workers=workers) as classifier:
        for each in (classifier.network.session, classifier._preprocessing):
            options = each.get_session_options()
            assert {key: options.get_session_config_entry(key) for key in session.NO_SPINNING} == session.NO_SPINNING
    with pytest.raises(RuntimeError):  # no entry: onnxruntime's default (spinning)
        OnnxClassifier(MODEL_DIR, providers="cpu").session.get_session_options().get_session_config_entry(
            "session.intra_op.allow_spinning")


@pytest.mark.parametrize("image, error", [(np.zeros((40, 40, 3), np.float32), TypeError),
                                          ("digit.png", TypeError), (np.zeros((40, 40), np.uint8), ValueError)],
                         ids=["float pixels", "a path", "rank 2"])
def test_a_callers_mistake_is_one_error_for_the_call(server, image, error):
    with pytest.raises(error, match="expected a decoded upload"):
        server.classify([image])


def test_the_preprocessing_runs_on_the_cpu_provider_whatever_runs_the_network(monkeypatch):
    asked = []
    real_session = ort.InferenceSession

    def recording(source, options=None, providers=None):
        asked.append((source, providers))
        return real_session(source, options, providers=[CPU])

    monkeypatch.setattr(ort, "InferenceSession", recording)
    monkeypatch.setattr(session, "cuda_can_start", lambda: True)  # as on a GPU machine: CUDA is asked for
    with pytest.warns(RuntimeWarning, match="running on CPUExecutionProvider"):  # no GPU here after all
        server = UploadClassifier(MODEL_DIR, providers=[CUDA, CPU], workers=1)
    network = [providers for source, providers in asked if not isinstance(source, bytes)]
    preprocessing = [providers for source, providers in asked if isinstance(source, bytes)]  # built in memory
    assert network == [[CUDA, CPU]] and preprocessing == [[CPU]]
    assert server.providers["preprocessing"] == [CPU]
    server.close()


def test_the_bundled_preprocessing_graph_is_the_runtimes_and_meant_for_the_cpu():
    bundled = onnx.load(str(LAYOUT.preprocess))
    built = preprocessing_model(OnnxClassifier(MODEL_DIR, providers="cpu").config)
    assert bundled.graph.SerializeToString() == built.graph.SerializeToString()
    assert {entry.key: entry.value for entry in bundled.metadata_props}[EXECUTION_PROVIDER] == CPU
    assert [value.name for value in bundled.graph.output] == [GRAPH_INPUT]


def test_the_bundled_preprocessing_graph_gives_the_python_paths_pixels_bit_for_bit(server):
    session = preprocessing_session(LAYOUT.preprocess)
    for path in SAMPLES[:4]:
        image = digit_on_paper(path)
        got = session.run([GRAPH_INPUT], {PIPELINE_INPUT: decoded_pixels(image)})[0]
        np.testing.assert_array_equal(got, preprocess(image, server.config)[None])


def test_an_export_refuses_a_preprocessing_graph_that_drifts_from_the_python_path(monkeypatch, tmp_path):
    """A graph that forgets a step (the normalisation's mean) is reported and not written; the
    export fails naming the uploads it disagreed on."""
    from vit_hub.export import VerificationError, export_onnx

    def drifting(config):
        return preprocessing_graph(ViTConfig.from_dict({**config.to_dict(), "mean": [0.0]}))

    monkeypatch.setattr(preprocess_graph, "preprocessing_graph", drifting)
    with pytest.raises(VerificationError, match="preprocess.onnx on image 0: expected the Python path's pixel values"):
        export_onnx(MODEL_DIR, tmp_path / "model.onnx")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model_export_report.failed.json"]  # nothing installed
    report = json.loads((tmp_path / "model_export_report.failed.json").read_text())
    assert report["preprocess"]["failures"] and not report["pipeline"]["pipeline.onnx"]["failures"]


# The CUDA provider's kernels ---------------------------------------------------------------------
# From onnxruntime's docs/OperatorKernels.md (microsoft/onnxruntime at 001d12d, the kernels of the
# 1.31 line), "Operators implemented by CUDAExecutionProvider": for each operator the graphs meant
# for CUDA use, the types its kernel takes, per input (by the input's type constraint), for the
# kernel that serves opset 18 (the export's) or, for ONNX Runtime's own operators, version 1.
FLOATS = {"float", "float16", "double", "bfloat16"}
NUMBERS = FLOATS | {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}
ANY = NUMBERS | {"bool"}
INDICES = {"int32", "int64"}
CUDA_KERNELS_OPSET = 18
CUDA_KERNELS: dict[tuple[str, str], dict[int, set[str]]] = {
    ("", "Add"): {0: NUMBERS}, ("", "Sub"): {0: NUMBERS}, ("", "Mul"): {0: NUMBERS}, ("", "Div"): {0: NUMBERS},
    ("", "Cast"): {0: ANY}, ("", "Concat"): {0: ANY}, ("", "ConstantOfShape"): {0: {"int64"}},
    ("", "Conv"): {0: {"float", "float16", "double"}},  # [11, 21]
    ("", "Equal"): {0: {"bool", "int32", "int64", "uint32", "uint64", "float", "float16", "double"}},
    ("", "Erf"): {0: FLOATS}, ("", "Exp"): {0: FLOATS}, ("", "Tanh"): {0: FLOATS}, ("", "Relu"): {0: FLOATS},
    ("", "Expand"): {0: ANY, 1: {"int64"}}, ("", "Gather"): {0: ANY, 1: INDICES},
    ("", "Gemm"): {0: FLOATS}, ("", "MatMul"): {0: FLOATS}, ("", "Softmax"): {0: FLOATS},
    ("", "LayerNormalization"): {0: FLOATS},  # 17+
    ("", "Pad"): {0: {"bool", "float", "float16", "double"}},  # 18+: no integer types
    ("", "ReduceMean"): {0: {"float", "float16", "double", "int32"}},  # 18+
    ("", "Reshape"): {0: ANY, 1: {"int64"}}, ("", "Shape"): {0: ANY}, ("", "Slice"): {0: ANY, 1: INDICES},
    ("", "Split"): {0: ANY}, ("", "Squeeze"): {0: ANY}, ("", "Unsqueeze"): {0: ANY}, ("", "Transpose"): {0: ANY},
    ("", "Where"): {0: {"bool"}, 1: {"bfloat16", "float", "float16", "double", "int32", "int64", "uint8"}},  # 16+
    ("com.microsoft", "BiasGelu"): {0: FLOATS},
    ("com.microsoft", "MultiHeadAttention"): {0: {"bfloat16", "float", "float16"}},
    ("com.microsoft", "SkipLayerNormalization"): {0: {"bfloat16", "float", "float16"}},
}
TYPE_NAMES = {"float32": "float", "float64": "double"}  # NumPy's names where the table's differ


def value_types(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> dict[str, str]:
    """The element type of every value of the main graph, as onnxruntime's CPU provider makes it."""
    probe = onnx.ModelProto.FromString(model.SerializeToString())
    known = {**feed, **{tensor.name: numpy_helper.to_array(tensor) for tensor in probe.graph.initializer}}
    wanted = [name for node in probe.graph.node for name in node.output if name and name not in known]
    del probe.graph.output[:]
    probe.graph.output.extend(onnx.ValueInfoProto(name=name) for name in wanted)
    session = ort.InferenceSession(probe.SerializeToString(), providers=[CPU])
    known.update(zip(wanted, session.run(wanted, feed)))
    return {name: TYPE_NAMES.get(value.dtype.name, value.dtype.name) for name, value in known.items()}


def nodes_without_cuda_kernel(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[str]:
    """'<op> on <types>' for each node (Constant aside) whose types the CUDA provider has no kernel
    for, '<op>: not in the table' for one the table does not list."""
    opsets = {entry.domain: entry.version for entry in model.opset_import}
    assert opsets.get("", opsets.get("ai.onnx")) == CUDA_KERNELS_OPSET, "the table holds the opset-18 kernels"
    types = value_types(model, feed)
    missing = []
    for node in model.graph.node:
        kernel = CUDA_KERNELS.get((node.domain, node.op_type))
        found = [types[name] if name else None for name in node.input]
        if node.op_type == "Constant":
            continue
        if kernel is None:
            missing.append(f"{node.op_type}: not in the table")
        elif any(index < len(found) and found[index] is not None and found[index] not in allowed
                 for index, allowed in kernel.items()):
            missing.append(f"{node.op_type} on {', '.join(map(str, found))}")
    return missing


@pytest.mark.parametrize("graph", ["logits", "fp16"])
def test_every_node_of_the_graphs_meant_for_cuda_has_a_cuda_kernel(graph):
    path = LAYOUT.logits if graph == "logits" else LAYOUT.in_precision(LAYOUT.logits, "fp16")
    feed = {GRAPH_INPUT: np.zeros((2, 1, 28, 28), np.float32)}
    assert nodes_without_cuda_kernel(onnx.load(str(path)), feed) == []


def test_the_kernel_check_finds_what_cuda_has_no_kernel_for():
    def padded(dtype: int) -> onnx.ModelProto:
        pads = numpy_helper.from_array(np.array([1, 1], np.int64), "pads")
        nodes = [helper.make_node("Pad", ["x", "pads"], ["padded"]), helper.make_node("Abs", ["padded"], ["y"])]
        graph = helper.make_graph(nodes, "pad", [helper.make_tensor_value_info("x", dtype, [2])],
                                  [helper.make_tensor_value_info("y", dtype, [4])], [pads])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)

    assert nodes_without_cuda_kernel(padded(onnx.TensorProto.FLOAT), {"x": np.zeros(2, np.float32)}) == \
        ["Abs: not in the table"]  # an operator the table does not list fails until it is added
    assert nodes_without_cuda_kernel(padded(onnx.TensorProto.UINT8), {"x": np.zeros(2, np.uint8)}) == \
        ["Pad on uint8, int64", "Abs: not in the table"]  # CUDA's Pad takes no integers


def test_a_large_jpeg_is_decoded_at_the_scale_the_model_needs(server, tmp_path):
    """UploadClassifier.decode reads a 2400x1800 phone JPEG of a digit at 1/2 a side (1/4 would
    leave 450 pixels, under decode_side's 512 for a digit model), from a file or its bytes, and
    the reduced picture gets the full decode's label and nearly its probabilities."""
    path = tmp_path / "photo.jpg"
    digit_on_paper(SAMPLES[2], canvas=(2400, 1800), at=(700, 450), side=900).save(path, quality=90)
    reduced, full = server.decode(path), decoded_upload(path)
    assert reduced.shape == (900, 1200, 1) and full.shape == (1800, 2400, 3)  # a digit model's: gray levels
    np.testing.assert_array_equal(server.decode(path.read_bytes()), reduced)
    small, whole = (answer.probabilities for answer in server.classify([reduced, full]))
    assert small.argmax() == whole.argmax() == int(SAMPLES[2].stem.split("_")[-1])
    assert np.abs(small - whole).max() < 0.01


def test_a_digit_model_decodes_gray_levels_that_give_the_colour_uploads_pixels_bit_for_bit(server, uploads, tmp_path):
    """UploadClassifier.decode hands a digit model's graph the gray levels [h, w, 1] (alpha over
    white, Pillow's convert("L"), as `preprocess` makes them) instead of the colour and alpha
    channels it would convert itself, operator by operator: the same pixel values, bit for bit,
    or the same refusal, for every kind of upload (gray, RGB, alpha)."""
    colour, made = uploads
    for index, (pixels, image) in enumerate(zip(colour, made)):
        path = tmp_path / f"upload_{index}.png"
        image.save(path)
        gray = server.decode(path)
        assert gray.shape == (*pixels.shape[:2], 1) and gray.dtype == np.uint8
        got, expected = server._prepared(gray), server._prepared(pixels)  # pixel values, or the refusal
        assert type(got) is type(expected)
        np.testing.assert_array_equal(got, expected)
    assert {pixels.shape[2] for pixels in colour} >= {1, 3, 4}  # gray, RGB and RGBA uploads were tried


# explain=True: the page's opening map, from pipeline_explain.onnx ---------------------------------
def test_a_batch_asked_to_explain_gets_each_uploads_map_as_the_graph_gives_it_alone(server, uploads):
    """Each answer not refused carries pipeline_explain.onnx's map (the page's opening method,
    integrated gradients + gradient rollout for the bundled model) and rollout of its upload,
    equal to that graph run on the upload alone, for the class the answer gives; a refused one
    carries none, and an answer not asked to explain none either."""
    pixels, _ = uploads
    batched = server.classify(pixels, explain=True)
    graph = pipeline_session(LAYOUT.pipeline_explain)
    assert server.map_method == "integrated_gradients_rollout"
    assert labels(batched) == labels(server.classify(pixels)) and batched[0].map.shape == server.config.grid_size
    for upload, answer in zip(pixels, batched):
        if answer.refusal is not None:
            assert answer.map is None and answer.rollout is None
            continue
        opening, rollout, probabilities = graph.run([PIPELINE_MAP, PIPELINE_ROLLOUT, PIPELINE_OUTPUT],
                                                    {PIPELINE_INPUT: upload})
        np.testing.assert_allclose(answer.map, opening, atol=1e-6, rtol=0)
        np.testing.assert_allclose(answer.rollout, rollout, atol=1e-6, rtol=0)
        assert int(probabilities.argmax()) == int(answer.probabilities.argmax())
    assert server.classify(pixels[:1])[0].map is None


def test_explain_without_the_explain_graph_names_the_export_flag(uploads, tmp_path):
    for name in (LAYOUT.logits.name, LAYOUT.config.name):
        (tmp_path / name).write_bytes((MODEL_DIR / name).read_bytes())
    with UploadClassifier(tmp_path, providers="cpu", workers=1) as classifier:
        assert classifier.classify(uploads[0][:1])[0].probabilities is not None
        with pytest.raises(FileNotFoundError, match=r"^explain=True: expected pipeline_explain.onnx in .*--output-attentions$"):
            classifier.classify(uploads[0][:1], explain=True)
