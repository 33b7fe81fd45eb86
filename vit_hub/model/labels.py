"""Class names a person can read and tell apart, checked wherever labels enter a config.

`vit-hub predict` prints `photo.jpg: LABEL 0.998`, and the app, the static page and the model
card show each label, so `ViTConfig` (which training, import and every load go through, a
training folder's class names included) refuses, in one line naming the label:

  - a control character (Unicode's category C: newlines, terminal escapes, bidirectional
    overrides, zero-width and other format characters) or a line or paragraph separator
    (`vit_hub.console.is_control`): it would forge a line or steer the terminal;
  - a label that shows nothing: one with no character left once spaces and the characters that
    draw nothing (INVISIBLE: the Hangul fillers, the blank Braille pattern, variation selectors,
    the combining grapheme joiner) are taken out, such as "", " " or U+3164;
  - a label that starts with a combining mark (category M, a lone U+0301 above all): it draws
    onto whatever is printed before it;
  - two labels with one `label_key`, which would read as one class: the label's compatibility
    form (NFKC: "ﬁ" is "fi", a decomposed "é" the composed one) without INVISIBLE characters,
    its spaces collapsed to one and trimmed, and the Greek and Cyrillic letters that look like
    Latin ones written as those (LOOK_ALIKES). So "7" and "7 ", "7" and "7" + U+2800, Latin "o"
    and Cyrillic "о", Latin "A" and Greek "Α" are refused side by side; a label set written all
    in Greek or Cyrillic is untouched (within one script no two letters map to one).

Torch-free, as the rest of `vit_hub.model.config`'s checks.
"""

from __future__ import annotations

import collections
import unicodedata

from vit_hub.console import is_control
from vit_hub.model.fields import ConfigError, shown

# Letters and symbols that draw nothing: the Hangul fillers (U+115F, U+1160, U+3164, U+FFA0), the
# blank Braille pattern (U+2800), the combining grapheme joiner (U+034F), Khmer's inherent vowels
# (U+17B4-17B5), Mongolian's and Unicode's variation selectors. (Format characters, such as the
# zero-width space, are category C: refused as control characters.)
INVISIBLE = frozenset(map(chr, [0x115F, 0x1160, 0x3164, 0xFFA0, 0x2800, 0x034F, 0x17B4, 0x17B5,
                                *range(0x180B, 0x1810), *range(0xFE00, 0xFE10), *range(0xE0100, 0xE01F0)]))
# Greek and Cyrillic letters that print as a Latin one in common fonts -> that Latin letter.
LOOK_ALIKES = str.maketrans(
    "ΑΒΕΖΗΙΚΜΝΟΡΤΥΧο" "АВЕКМНОРСТХУЅІЈаеорсхуѕіјԁһԛԝ",
    "ABEZHIKMNOPTYXo" "ABEKMHOPCTXYSIJaeopcxysijdhqw")


def label_key(label: str) -> str:
    """What tells two class names apart when a person reads them (see the module docstring):
    NFKC, without INVISIBLE characters, spaces collapsed and trimmed, look-alikes as Latin."""
    text = unicodedata.normalize("NFKC", label)
    text = unicodedata.normalize("NFKC", "".join(char for char in text if char not in INVISIBLE))
    return " ".join(text.split()).translate(LOOK_ALIKES)


def check_labels(labels: list[str]) -> None:
    """A one-line ConfigError naming the first label a person could not read or tell apart from
    another (the rules of the module docstring)."""
    steering = [label for label in labels if any(map(is_control, label))]
    if steering:  # a newline or a terminal escape in a label would forge lines of `vit-hub predict`
        raise ConfigError(f"labels: expected names without control characters (newlines, terminal escapes), "
                          f"found {shown(steering[0])}")
    for label in labels:
        _check_it_shows(label)
    keys = collections.Counter(map(label_key, labels))
    repeated = sorted({label for label in labels if keys[label_key(label)] > 1})
    if repeated:  # a prediction "x 0.91, x 0.01" would name no class
        written = f" (written {_escaped(repeated)})" if ascii(repeated) != repr(repeated) else ""
        raise ConfigError(f"labels: expected a different name for each class, found {shown(repeated)} "
                          f"more than once{written}")


def _check_it_shows(label: str) -> None:
    key = label_key(label)
    if not key:
        raise ConfigError(f"labels: expected names that show as text, found {_escaped(label)}, which prints as "
                          f"nothing (spaces and characters that draw nothing)")
    if unicodedata.category(key[0]).startswith("M"):
        raise ConfigError(f"labels: expected names that start with a letter, digit or symbol, found "
                          f"{_escaped(label)}, which starts with a combining mark (it draws onto the text before it)")


def _escaped(value: str | list[str], limit: int = 60) -> str:
    """ascii(value), cut to `limit` characters: every character beyond ASCII as its escape, so a
    message shows what a label holds, not what it looks like."""
    text = ascii(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"
