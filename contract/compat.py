"""Wire compatibility of the contract across releases (design §12): a release's messages
must be read by the release before it and read what it wrote, so protobuf's rules hold —
checked in `make test` against the descriptor sets of earlier releases kept in
`contract/history/` (`python -m contract.generate --snapshot NAME` adds one).

The rules (a subset of `buf breaking`'s WIRE_JSON category, since payloads travel as
protojson): a message keeps its name and its topic keys; a field keeps its number, name,
type and label; a field removed has its number and name reserved; a field number or name
is never reused for another field; an enum value keeps its number and name.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from google.protobuf import descriptor_pb2

HISTORY = Path(__file__).resolve().parent / "history"


def load(path: Path) -> descriptor_pb2.FileDescriptorSet:
    descriptors = descriptor_pb2.FileDescriptorSet()
    descriptors.ParseFromString(path.read_bytes())
    return descriptors


def _messages(files: descriptor_pb2.FileDescriptorSet
              ) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto]]:
    def walk(prefix: str, messages: object) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto]]:
        for message in messages:  # type: ignore[attr-defined]
            name = f"{prefix}.{message.name}"
            yield name, message
            yield from walk(name, message.nested_type)

    for file in files.file:
        if file.package.startswith("google.protobuf"):
            continue
        yield from walk(f".{file.package}" if file.package else "", file.message_type)


def _enums(files: descriptor_pb2.FileDescriptorSet
           ) -> Iterator[tuple[str, descriptor_pb2.EnumDescriptorProto]]:
    for file in files.file:
        if file.package.startswith("google.protobuf"):
            continue
        prefix = f".{file.package}" if file.package else ""
        for enum in file.enum_type:
            yield f"{prefix}.{enum.name}", enum
        for name, message in _messages(descriptor_pb2.FileDescriptorSet(file=[file])):
            for enum in message.enum_type:
                yield f"{name}.{enum.name}", enum


def _reserved(message: descriptor_pb2.DescriptorProto, number: int, name: str) -> bool:
    numbers = any(r.start <= number < r.end for r in message.reserved_range)
    return numbers and name in message.reserved_name


def _topic_keys(message: descriptor_pb2.DescriptorProto) -> bytes:
    return message.options.SerializeToString(deterministic=True)


def breaking_changes(old: descriptor_pb2.FileDescriptorSet,
                     new: descriptor_pb2.FileDescriptorSet) -> list[str]:
    """What ``new`` breaks of ``old``'s wire contract, one line each ([] when nothing)."""
    problems: list[str] = []
    new_messages = dict(_messages(new))
    for name, before in _messages(old):
        after = new_messages.get(name)
        if after is None:
            problems.append(f"message {name} was removed")
            continue
        if _topic_keys(before) != _topic_keys(after):
            problems.append(f"message {name}: its options (topic keys) changed")
        fields_after = {f.number: f for f in after.field}
        names_after = {f.name: f for f in after.field}
        for field in before.field:
            now = fields_after.get(field.number)
            if now is None:
                if not _reserved(after, field.number, field.name):
                    problems.append(f"{name}.{field.name} ({field.number}) was removed "
                                    f"without reserving its number and name")
                if field.name in names_after:
                    problems.append(f"{name}: the name {field.name!r} of field "
                                    f"{field.number} is reused by field "
                                    f"{names_after[field.name].number}")
                continue
            if now.name != field.name:
                problems.append(f"{name}: field {field.number} was {field.name!r}, now "
                                f"{now.name!r}")
            if (now.type, now.type_name) != (field.type, field.type_name):
                problems.append(f"{name}.{field.name}: its type changed")
            if now.label != field.label:
                problems.append(f"{name}.{field.name}: its label (repeated/optional) "
                                f"changed")
    new_enums = dict(_enums(new))
    for name, before_enum in _enums(old):
        after_enum = new_enums.get(name)
        if after_enum is None:
            problems.append(f"enum {name} was removed")
            continue
        values = {v.number: v.name for v in after_enum.value}
        for value in before_enum.value:
            if values.get(value.number) != value.name:
                problems.append(f"enum {name}: value {value.number} was {value.name!r}, now "
                                f"{values.get(value.number)!r}")
    return problems
