"""Labels that print as nothing or as another class (`vit_hub.model.labels`): "", " ", a Hangul
filler, a lone combining mark, and "7" beside "7" + a blank Braille pattern, Latin "o" beside
Cyrillic "о", Latin "A" beside Greek "Α" are refused in one line naming the label, wherever labels
enter: a config.json read by load_model, `vit-hub predict` and the app, and a training folder's
class names before training. Label sets a person writes in one script, with accents or
diacritics that tell words apart, and the bundled models' labels still load."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import TINY_TRAIN_FLAGS, assert_one_line, tiny_config, write_class_folders
from test_untrusted_models import assert_refused_by_python_cli_and_app, run_vit_hub, with_config
from vit_hub.hub.pretrained import HubVisionTransformer
from vit_hub.model.config import ViTConfig
from vit_hub.model.fields import ConfigError
from vit_hub.model.labels import label_key

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("labels") / "tiny"
    HubVisionTransformer(**tiny_config()).save_pretrained(folder)
    return folder


SHOWS_NOTHING = "labels: expected names that show as text, found {}, which prints as nothing"
STARTS_WITH_A_MARK = "labels: expected names that start with a letter, digit or symbol, found {}, which starts"
READ_ALIKE = "labels: expected a different name for each class, found {} more than once (written {})"
REFUSED = {  # id: (labels, what the refusal says)
    "empty": (["", "1"], SHOWS_NOTHING.format("''")),
    "space": ([" ", "1"], SHOWS_NOTHING.format("' '")),
    "hangul-filler": (["\u3164", "1"], SHOWS_NOTHING.format(r"'\u3164'")),
    "braille-blank": (["\u2800", "1"], SHOWS_NOTHING.format(r"'\u2800'")),
    "lone-combining-mark": (["\u0301", "1"], STARTS_WITH_A_MARK.format(r"'\u0301'")),
    "7-and-7-braille-blank": (["7", "7\u2800"], READ_ALIKE.format("['7', '7\u2800']", r"['7', '7\u2800']")),
    "latin-and-cyrillic-o": (["o", "\u043e"], READ_ALIKE.format("['o', '\u043e']", r"['o', '\u043e']")),
    "latin-and-greek-A": (["A", "\u0391"], READ_ALIKE.format("['A', '\u0391']", r"['A', '\u0391']")),
}


@pytest.mark.parametrize("labels, message", REFUSED.values(), ids=REFUSED.keys())
def test_a_label_that_prints_as_nothing_or_as_another_is_refused_where_the_config_is_read(model_dir, tmp_path,
                                                                                         labels, message):
    """load_model, `vit-hub predict` (which printed `digit.png:  0.998` for "") and the app."""
    refused = with_config(model_dir, tmp_path / "model", labels=labels)
    assert_refused_by_python_cli_and_app(refused, message)


@pytest.mark.parametrize("names, message", [
    ([" ", "cat"], SHOWS_NOTHING.format("' '")),
    (["\u3164", "cat"], SHOWS_NOTHING.format(r"'\u3164'")),
    (["o", "\u043e"], READ_ALIKE.format("['o', '\u043e']", r"['o', '\u043e']")),
], ids=["space", "hangul-filler", "latin-and-cyrillic-o"])
def test_class_folders_that_make_such_labels_are_refused_before_training(tmp_path, names, message):
    data = tmp_path / "data"
    write_class_folders(data, per_class=2, seed=0)
    for old, new in zip(sorted(path.name for path in data.iterdir()), names):
        (data / old).rename(data / new)
    code, stderr = run_vit_hub("train", "--data", data, "--out", tmp_path / "out", "--epochs", "1", *TINY_TRAIN_FLAGS)
    assert code == 2
    assert_one_line(stderr, message)
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize("labels", [
    ["\u043a\u043e\u0442", "\u0441\u043e\u0431\u0430\u043a\u0430", "\u0421\u0410\u0420"],  # Cyrillic: кот, собака, САР
    ["\u0391\u03b8\u03ae\u03bd\u03b1", "\u039f\u03bb\u03c5\u03bc\u03c0\u03af\u03b1"],  # Greek: Αθήνα, Ολυμπία
    ["ma", "m\u00e1", "m\u00e0", "m\u1ea3", "m\u00e3", "m\u1ea1"],  # Vietnamese: six words
    ["ice cream", "icecream", "Ice cream"],
], ids=["cyrillic", "greek", "vietnamese-diacritics", "spaces-and-case"])
def test_labels_a_person_tells_apart_are_accepted(labels):
    assert ViTConfig(**tiny_config(labels=labels)).labels == labels


@pytest.mark.parametrize("config", sorted((ROOT / "models").glob("*/config.json")), ids=lambda path: path.parent.name)
def test_the_bundled_models_labels_load(config):
    assert ViTConfig.from_json(config).labels


def test_the_key_of_a_label_is_what_a_reader_sees():
    assert label_key("  ice \u00a0 cream\u3164 ") == "ice cream"
    assert label_key("\u0421\u0410\u0420") == "CAP" and label_key("\u0391\u0392") == "AB"
    with pytest.raises(ConfigError):
        ViTConfig(**tiny_config(labels=["e\u034f\u0301", "\u00e9"]))  # a joiner between e and its accent
