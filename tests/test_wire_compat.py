"""Issue 25, item 5: the wire contract keeps protobuf's compatibility rules against every
earlier release kept in contract/history/ (3cbbf76: the release this one upgrades from),
and the check catches each kind of break."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from contract.compat import HISTORY, breaking_changes, load
from contract.generate import descriptor_set

RELEASES = sorted(HISTORY.glob("*.binpb"))


def _current() -> descriptor_pb2.FileDescriptorSet:
    files = descriptor_pb2.FileDescriptorSet()
    files.ParseFromString(descriptor_set())
    return files


def test_the_release_this_one_upgrades_from_is_kept() -> None:
    assert HISTORY / "3cbbf76.binpb" in RELEASES


@pytest.mark.parametrize("release", RELEASES, ids=lambda p: p.stem)
def test_the_contract_breaks_nothing_of_an_earlier_release(release: Path) -> None:
    assert breaking_changes(load(release), _current()) == []


def _message(files: descriptor_pb2.FileDescriptorSet,
             name: str) -> descriptor_pb2.DescriptorProto:
    return next(m for f in files.file for m in f.message_type if m.name == name)


def test_each_kind_of_break_is_caught() -> None:
    old = load(HISTORY / "3cbbf76.binpb")

    renamed = _current()
    next(f for f in _message(renamed, "BuildRequest").field if f.number == 2).name = "queue"
    assert any("field 2 was 'queue_name'" in p for p in breaking_changes(old, renamed))

    retyped = _current()
    next(f for f in _message(retyped, "BuildRequest").field
         if f.name == "attempt").type = descriptor_pb2.FieldDescriptorProto.TYPE_STRING
    assert any("attempt: its type changed" in p for p in breaking_changes(old, retyped))

    removed = _current()
    build = _message(removed, "BuildRequest")
    nonce = next(f for f in build.field if f.name == "nonce")
    build.field.remove(nonce)
    assert any("nonce (3) was removed without reserving" in p
               for p in breaking_changes(old, removed))
    build.reserved_range.add(start=3, end=4)
    build.reserved_name.append("nonce")
    assert breaking_changes(old, removed) == []  # removed the right way

    reused = _current()
    build = _message(reused, "BuildRequest")
    build.field.remove(next(f for f in build.field if f.name == "nonce"))
    build.field.add(name="token", number=3, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
                    label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    assert any("field 3 was 'nonce', now 'token'" in p for p in breaking_changes(old, reused))

    gone = _current()
    for file in gone.file:
        for message in list(file.message_type):
            if message.name == "Record":
                file.message_type.remove(message)
    assert any(p.startswith("message ") and p.endswith("Record was removed")
               for p in breaking_changes(old, gone))
