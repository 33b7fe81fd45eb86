"""Malformed image files, as a fuzzer makes them, are one line wherever an image is opened
(`open_image`: `vit-hub predict`, the app, the GPU server), never a traceback.

Pillow's format plugins parse headers and metadata in Python and fail with whatever a bad
field breaks (ValueError, IndexError, NotImplementedError, SyntaxError); each file below
made `vit-hub predict` print a 44- or 61-line traceback before `open_image` caught them all.
A malformed EXIF block in an image whose pixels decode is read as no orientation: the image
is answered as stored. Each file is built here, one changed byte or chunk from a good one.
"""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import assert_one_line
from vit_hub import cli
from vit_hub.errors import UserError
from vit_hub.export.batched_runtime import decoded_upload
from vit_hub.processing.preprocess import UPLOAD_MAX_PIXELS, load_image, open_image

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "vit-mnist"
DIGIT = ROOT / "vit_hub" / "bundled" / "samples" / "mnist_test_0000_label_7.png"  # a 7


def saved(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def noise() -> Image.Image:
    return Image.fromarray(np.random.default_rng(0).integers(0, 255, (24, 20, 3), np.uint8))


def changed(data: bytes, at: int, value: bytes) -> bytes:
    return data[:at] + value + data[at + len(value):]


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_with_chunk(kind: bytes, data: bytes) -> bytes:
    """The digit with one more chunk right after its IHDR (8-byte signature + 25-byte IHDR)."""
    png = DIGIT.read_bytes()
    return png[:33] + png_chunk(kind, data) + png[33:]


ZLIB_BOMB = zlib.compress(bytes(64 * 2**20), 9)  # 64 KB that inflate to 64 MB: over Pillow's text limit


def malformed() -> dict[str, bytes]:
    """Files that do not decode, each with the exception Pillow raised for it (uncaught before)."""
    dds = saved(Image.new("RGB", (8, 8)), "DDS")
    dds = changed(changed(dds, 80, struct.pack("<I", 4)), 84, b"XYZW")  # DDPF_FOURCC, an unknown FourCC
    return {
        "PNG, an iCCP chunk inflating past Pillow's limit (ValueError)": png_with_chunk(b"iCCP", b"icc\0\0" + ZLIB_BOMB),
        "PNG, a zTXt chunk inflating past Pillow's limit (ValueError)": png_with_chunk(b"zTXt", b"note\0\0" + ZLIB_BOMB),
        "DDS, an unknown pixel format (NotImplementedError)": dds,
        "QOI, a width one more than its data holds (IndexError)": changed(saved(noise(), "QOI"), 7, b"\x15"),
        "PPM, a width that is not a number (ValueError)": changed(saved(noise(), "PPM"), 3, b"A"),
        "IM, a size that is not a number (ValueError)": changed(saved(noise(), "IM"), 40, b"A"),
    }


CASES = malformed()


@pytest.mark.parametrize("name", CASES)
def test_a_malformed_file_is_one_line_from_open_image(name, tmp_path):
    path = tmp_path / "upload.img"
    path.write_bytes(CASES[name])
    with pytest.raises(UserError) as refused:
        open_image(path, "upload.img", UPLOAD_MAX_PIXELS)
    assert_one_line(str(refused.value), "upload.img is not a readable image")
    with pytest.raises(UserError) as refused:  # the bytes a server receives, the same way
        decoded_upload(CASES[name])
    assert_one_line(str(refused.value), "the upload is not a readable image")


@pytest.mark.parametrize("name", list(CASES)[:3])
def test_vit_hub_predict_says_one_line(name, tmp_path, capsys):
    path = tmp_path / "upload.png"
    path.write_bytes(CASES[name])
    assert cli.main(["predict", "--model", str(MODEL_DIR), str(path)]) == 2
    stderr = capsys.readouterr().err
    assert_one_line(stderr.removeprefix("error: "), f"{path} is not a readable image")


def test_the_app_says_one_line(tmp_path, monkeypatch):
    """The app's reading of an upload (read_upload: open_image on Gradio's copy of the file)."""
    import gradio as gr
    from gradio.utils import get_upload_folder

    from vit_hub.demo.uploads import read_upload

    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "gradio"))
    folder = Path(get_upload_folder()) / "3f2a"
    folder.mkdir(parents=True)
    for name, data in CASES.items():
        (folder / "upload.png").write_bytes(data)
        with pytest.raises(gr.Error) as refused:
            read_upload({"path": str(folder / "upload.png"), "orig_name": "notes.png"})
        assert_one_line(refused.value.message, "notes.png is not a readable image"), name


def test_an_unreadable_exif_block_is_read_as_no_orientation(tmp_path):
    """A PNG whose eXIf chunk is no TIFF structure (Pillow raised SyntaxError reading it) is
    the digit as stored, answered like the digit itself."""
    path = tmp_path / "digit.png"
    path.write_bytes(png_with_chunk(b"eXIf", b"garbage!"))
    np.testing.assert_array_equal(decoded_upload(path), decoded_upload(DIGIT))


def test_an_exif_orientation_still_turns_a_photo_upright(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: shown turned 90 degrees clockwise
    stored = Image.open(DIGIT).convert("L")
    path = tmp_path / "rotated.png"
    stored.save(path, exif=exif.tobytes())
    upright = load_image(open_image(path))
    assert np.array_equal(np.asarray(upright), np.asarray(stored.transpose(Image.Transpose.ROTATE_270)))


FUZZED_FORMATS = ["PNG", "JPEG", "GIF", "BMP", "TIFF", "WEBP", "QOI", "DDS", "PPM", "IM", "PCX", "TGA", "SGI", "ICO"]


def test_fuzzed_files_are_refused_in_one_line_or_decoded(tmp_path):
    """60 mutants of a small image in each of 14 formats (1-5 bytes changed, seeded): each one
    decodes, or is refused with a UserError in one line. Before, 31 of these 840 raised
    something else: ValueError from PPM, IM and SGI headers, IndexError from QOI streams."""
    rng = np.random.default_rng(61)
    outcomes = {"decoded": 0, "refused": 0}
    for fmt in FUZZED_FORMATS:
        good = saved(noise().convert("P") if fmt == "GIF" else noise(), fmt)
        for _ in range(60):
            mutant = bytearray(good)
            for _ in range(rng.integers(1, 6)):  # half of the changes in the header's 64 bytes
                mutant[rng.integers(0, 64 if rng.random() < 0.5 else len(mutant))] = rng.integers(0, 256)
            (tmp_path / "mutant").write_bytes(mutant)
            try:
                decoded_upload(tmp_path / "mutant")
                outcomes["decoded"] += 1
            except UserError as refused:
                assert_one_line(str(refused))
                outcomes["refused"] += 1
    assert sum(outcomes.values()) == 60 * len(FUZZED_FORMATS) and min(outcomes.values()) > 100, outcomes
