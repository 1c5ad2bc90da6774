"""What the YAML configuration files share: reading a file, the value types their models
are made of, and one translation of pydantic's validation errors into Stovepipe's own
messages — each with the YAML path it was found at, every problem at once.

Models are pydantic v2 models (file sections) and pydantic dataclasses (extension specs,
so they can be built by hand positionally). Every user-visible field uses a type from
here, so a message always says what was expected and what was found:
``queues.q.max_concurrent: must be a positive integer, got 0``.

Relative paths are resolved against the directory of the file being loaded (passed as the
validation context ``{"base_dir": Path}``); a spec built by hand keeps its paths as given.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, ValidationError
from pydantic import ValidationInfo as _ValidationInfo

from streams.schema.durations import format_duration, parse_duration

E = TypeVar("E", bound=Exception)

# Sections of a file refuse keys they do not know; extension specs too.
SECTION = ConfigDict(extra="forbid")
SPEC = ConfigDict(extra="forbid")  # used with @dataclass(frozen=True)


class Section(BaseModel):
    """A mapping in a configuration file: unknown keys are an error."""

    model_config = SECTION


# --- value types ----------------------------------------------------------------------------


def _positive_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"must be a positive integer, got {value!r}")
    return value


def _positive_float(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"must be a positive number, got {value!r}")
    return float(value)


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"must be a whole number, 0 or more, got {value!r}")
    return value


def _duration(value: object) -> timedelta:
    delta = value if isinstance(value, timedelta) else parse_duration(value)
    if delta <= timedelta(0):
        raise ValueError(f"must be longer than zero, got {value!r} ({format_duration(delta)})")
    return delta


def _non_empty_string(value: object) -> str:
    if not isinstance(value, str) or not value.strip() or value != value.strip():
        raise ValueError(f"expected a non-empty string without surrounding spaces, got "
                         f"{value!r}")
    return value


def _path_text(value: object) -> object:
    return value if isinstance(value, Path) else _non_empty_string(value)


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


def is_env_name(value: object) -> bool:
    """Whether ``value`` can name an environment variable."""
    return isinstance(value, str) and _ENV_NAME.fullmatch(value) is not None


def _secret_env_name(value: object) -> str:
    # the value is never repeated in the message: it might be the secret itself
    if not is_env_name(value):
        raise ValueError("expected the NAME of an environment variable (letters, digits and "
                         "'_', not starting with a digit), e.g. STOVEPIPE_GITHUB_TOKEN; the "
                         "secret itself belongs in that variable, never in this file (the "
                         "value given is not shown)")
    assert isinstance(value, str)
    return value


def _flag(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def resolve_path(value: Path, info: _ValidationInfo) -> Path:
    """``~`` expanded; relative to the loaded file's directory when there is one."""
    path = value.expanduser()
    base = (info.context or {}).get("base_dir") if info is not None else None
    return path if path.is_absolute() or base is None else Path(base) / path


PositiveInt = Annotated[int, BeforeValidator(_positive_int)]
Count = Annotated[int, BeforeValidator(_count)]
PositiveFloat = Annotated[float, BeforeValidator(_positive_float)]
Duration = Annotated[timedelta, BeforeValidator(_duration)]
NonEmptyStr = Annotated[str, BeforeValidator(_non_empty_string)]
Flag = Annotated[bool, BeforeValidator(_flag)]
# where a secret is: the name of the variable that holds it, never the secret
SecretEnvName = Annotated[str, BeforeValidator(_secret_env_name)]
ConfigPath = Annotated[Path, BeforeValidator(_path_text), AfterValidator(resolve_path)]


@dataclass(frozen=True)
class KindInfo:
    """Marks a union of specs told apart by their ``kind`` (``source_control``,
    ``build_runner``), for messages: what it is and an example of one."""

    what: str
    example: str


def kind_of(spec_type: type) -> str:
    """The ``kind`` a spec class answers to (its ``kind`` field's default)."""
    fields = _fields_of(spec_type)
    if fields is None or "kind" not in fields:
        raise TypeError(f"{spec_type!r} is not a spec class with a 'kind'")
    return str(fields["kind"].default)


# --- reading ----------------------------------------------------------------------------------


def read_yaml(path: Path, error: Callable[[Path, list[str]], E]) -> Any:
    """The parsed file; ``error(path, [reason])`` raised when it cannot be read or parsed."""
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


class Problems:
    """Problems found in a file, each ``"<YAML path>: <message>"``, in order, once each
    (a bad default is reported once, not once per entry that uses it)."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, where: str, message: str) -> None:
        line = f"{where or '(top level)'}: {message}"
        if line not in self.items:
            self.items.append(line)

    def add_validation_error(self, exc: ValidationError, root: Any, where: str = "") -> None:
        """Every error of ``exc``, raised validating ``root`` found at ``where``."""
        for error in exc.errors():
            self.add(*_translate(error, root, where))


# --- pydantic errors, in our words -------------------------------------------------------------


def _translate(error: Any, root: Any, prefix: str) -> tuple[str, str]:
    kind = error["type"]
    loc = tuple(error["loc"])
    value = error.get("input")
    ctx = error.get("ctx") or {}
    if kind in ("missing", "extra_forbidden", "unexpected_keyword_argument"):
        parent, node = _locate(root, loc[:-1], prefix)
        node = _strip(node)  # an optional section: the model it holds
        name = str(loc[-1])
        if kind == "missing":
            example = _example(node, name)
            return parent, f"missing {name!r}" + (f", e.g. {example}" if example else "")
        known = sorted(_fields_of(node) or {})
        return parent, f"unknown field {name!r}" + (f"; expected one of {known}" if known
                                                    else "")
    where, node = _locate(root, loc, prefix)
    info = _kind_info(node)
    if kind == "union_tag_invalid":
        tags = _tags(node)
        what = info.what if info else "kind"
        return f"{where}.kind", f"unknown {what} kind {ctx.get('tag')!r}; expected one of {tags}"
    if kind == "union_tag_not_found":
        return where, f"missing 'kind'; expected one of {_tags(node)}"
    if kind in ("model_attributes_type", "model_type", "dict_type", "dataclass_type",
                "dataclass_exact_type"):
        if info is not None:
            return where, f"expected a {info.what} mapping such as {info.example}, got {value!r}"
        return where, f"expected a mapping, got {type(value).__name__}"
    if kind in ("list_type", "tuple_type"):
        return where, f"expected a list, got {value!r}"
    if kind == "value_error":
        return where, str(ctx.get("error", error["msg"]))
    return where, f"{error['msg']}, got {value!r}"


def _locate(root: Any, loc: tuple[Any, ...], prefix: str) -> tuple[str, Any]:
    """The YAML path ``loc`` names (without pydantic's union tags and ``[key]`` markers),
    and the declared type found there (None past what the models declare)."""
    path = prefix
    node: Any = root
    for item in loc:
        node = _strip(node)
        if _is_kind_union(node):
            node = _member(node, item)  # the tag pydantic put in the location
            continue
        if item == "[key]":
            node = None
            continue
        if isinstance(item, int) and _origin(node) in (list, tuple):
            path += f"[{item}]"
            node = _args(node)[0] if _args(node) else None
            continue
        path = f"{path}.{item}" if path else str(item)
        fields = _fields_of(node)
        if fields is not None:
            field = fields.get(str(item))
            node = _field_type(field) if field is not None else None
        elif _origin(node) is dict:
            node = _args(node)[1] if len(_args(node)) == 2 else None
        else:
            node = None
    return path, node


def _strip(node: Any) -> Any:
    """``node`` without Optional; a union keeps its Annotated metadata (KindInfo)."""
    while True:
        if _origin(node) in (typing.Union, types.UnionType):
            members = [a for a in _args(node) if a is not type(None)]
            if len(members) == 1:
                node = members[0]
                continue
            return node
        if _origin(node) is Annotated:
            inner = typing.get_args(node)[0]
            if _origin(inner) in (typing.Union, types.UnionType):
                members = [a for a in _args(inner) if a is not type(None)]
                if len(members) > 1:
                    return node  # a kind union: keep its KindInfo
            node = inner
            continue
        return node


def _kind_info(node: Any) -> KindInfo | None:
    if node is None:
        return None
    node = _strip(node)
    if _origin(node) is Annotated:
        for meta in node.__metadata__:
            if isinstance(meta, KindInfo):
                return meta
    return None


def _union_members(node: Any) -> list[Any]:
    node = _strip(node)
    if _origin(node) is Annotated:
        node = typing.get_args(node)[0]
    if _origin(node) in (typing.Union, types.UnionType):
        return [a for a in _args(node) if a is not type(None)]
    return []


def _is_kind_union(node: Any) -> bool:
    members = _union_members(node)
    return len(members) > 1 and all("kind" in (_fields_of(m) or {}) for m in members)


def _tags(node: Any) -> list[str]:
    return [kind_of(m) for m in _union_members(node)]


def _member(node: Any, tag: Any) -> Any:
    for member in _union_members(node):
        if kind_of(member) == tag:
            return member
    return None


def _fields_of(node: Any) -> dict[str, Any] | None:
    if isinstance(node, type):
        if issubclass(node, BaseModel):
            return dict(node.model_fields)
        fields = getattr(node, "__pydantic_fields__", None)
        if fields is not None:
            return dict(fields)
    return None


def _field_type(field: Any) -> Any:
    annotation = field.annotation
    metadata = [m for m in field.metadata if isinstance(m, KindInfo)]
    return Annotated[annotation, *metadata] if metadata else annotation


def _example(node: Any, name: str) -> str | None:
    field = (_fields_of(node) or {}).get(name)
    examples = getattr(field, "examples", None) if field is not None else None
    return str(examples[0]) if examples else None


def _origin(node: Any) -> Any:
    return typing.get_origin(node)


def _args(node: Any) -> tuple[Any, ...]:
    return typing.get_args(node)
