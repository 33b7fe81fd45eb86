"""The checks every field of a config passes before anything is built from it: what each
annotation accepts (`check_fields`), fields limited to choices (`one_of`) or a range
(`within`), and JSON read with a size limit (`read_json`). ViTConfig and TrainSettings use
them; the messages name the field, what it takes and what it holds, in one line.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from pathlib import Path
from typing import Any

from vit_hub.errors import UserError

MAX_JSON_BYTES = 16 * 2**20  # a config.json with 100,000 labels is about 2 MB


class ConfigError(UserError):
    """A config value (from config.json, a flag or a Python caller) no model can be built from;
    the message names the field, what it takes and what it holds."""


def shown(value: Any, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters: a message stays one short line whatever was given."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        float(value)
    except OverflowError:  # an int of hundreds of digits
        return False
    return True


def _list_of(check):
    return lambda value: isinstance(value, (list, tuple)) and all(check(item) for item in value)


# What each part of a field's annotation (a string, under `from __future__ import annotations`)
# accepts, and how a message calls it. A tuple passes for a list (Python callers); JSON gives lists.
KINDS: dict[str, tuple[Any, str]] = {
    "int": (is_int, "an int"),
    "float": (is_number, "a number"),
    "bool": (lambda value: isinstance(value, bool), "true or false"),
    "str": (lambda value: isinstance(value, str), "a string"),
    "None": (lambda value: value is None, "null"),
    "list[int]": (_list_of(is_int), "a list of ints"),
    "list[float]": (_list_of(is_number), "a list of numbers"),
    "list[str]": (_list_of(lambda value: isinstance(value, str)), "a list of strings"),
}


def one_of(default: Any, choices: tuple) -> Any:
    """A dataclass field that only takes one of `choices` (checked by `check_fields`, and
    offered as the choices of its command-line flag)."""
    return dataclasses.field(default=default, metadata={"choices": choices})


def within(default: Any, low: int, high: int, what: str = "an int") -> Any:
    """A dataclass field whose int (or each int of its list) lies in [low, high], checked by
    `check_fields`; `what` names the value in the message ("sides" of an image size)."""
    return dataclasses.field(default=default, metadata={"range": (low, high), "what": what})


def check_fields(instance: Any) -> None:
    """A ConfigError naming the field, what it takes and what it holds, for the first field of a
    dataclass whose value does not fit its annotation, its `one_of` choices or its `within` range."""
    for field in dataclasses.fields(instance):
        value = getattr(instance, field.name)
        kinds = [KINDS[kind.strip()] for kind in field.type.split("|")]
        if not any(accepts(value) for accepts, _ in kinds):
            names = [name for _, name in kinds]
            expected = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
            raise ConfigError(f"{field.name}: expected {expected}, found {shown(value)}")
        choices = field.metadata.get("choices")
        if choices is not None and value is not None and value not in choices:
            raise ConfigError(f"{field.name}: expected one of {', '.join(map(str, choices))}, got {shown(value)}")
        low, high = field.metadata.get("range", (None, None))
        values = value if isinstance(value, (list, tuple)) else [value]
        if low is not None and value is not None and not all(low <= item <= high for item in values):
            raise ConfigError(f"{field.name}: expected {field.metadata['what']} from {low:,} to {high:,}, "
                             f"found {shown(value)}")


def read_json(path: str | Path, limit: int = MAX_JSON_BYTES) -> Any:
    """The value a JSON file holds; a one-line ConfigError for a file over `limit` bytes, one
    that is not JSON, or one nested too deep for Python's parser."""
    path = Path(path)
    with open(path, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise ConfigError(f"{path}: expected a JSON file of at most {limit // 2**20} MiB, found a larger one")
    try:
        return json.loads(data)
    except RecursionError:
        raise ConfigError(f"{path}: expected JSON nested a few levels deep, found nesting too deep to parse") from None
    except ValueError as error:  # not JSON, not UTF-8, or an int of more digits than Python converts
        raise ConfigError(f"{path} is not valid JSON: {error}") from None
