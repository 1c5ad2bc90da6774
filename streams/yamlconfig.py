"""What the YAML configuration loaders (topics.yaml, queues.yaml) share: reading a file,
and collecting every problem with the YAML path it was found at, so a user sees them all
at once."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass
class Value:
    value: Any
    where: str  # the YAML path it came from, for error messages


class Problems:
    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, where: str, message: str) -> None:
        line = f"{where}: {message}"
        if line not in self.items:  # a bad default is reported once, not per entry
            self.items.append(line)


def mapping(raw: Any, where: str, problems: Problems) -> dict[Any, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        problems.add(where, f"expected a mapping, got {type(raw).__name__}")
        return {}
    return raw


def check_fields(raw: Mapping[Any, Any], allowed: set[str], where: str,
                 problems: Problems) -> None:
    for key in raw:
        if key not in allowed:
            problems.add(where, f"unknown field {key!r}; expected one of {sorted(allowed)}")


def read_yaml(path: Path, error: Callable[[Path, list[str]], Exception]) -> Any:
    """The parsed file; `error(path, [reason])` raised when it cannot be read or parsed."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise error(path, [f"cannot read: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise error(path, [f"not UTF-8 text: {exc}"]) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(path, [f"not valid YAML: {exc}"]) from None
