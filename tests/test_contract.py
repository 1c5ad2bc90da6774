"""The wire contract: bindings, round-trips, tolerance of unknown fields, rejection of junk."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.message import Message
from hypothesis import given
from hypothesis import strategies as st

import contract
from contract import (
    PAYLOAD_TYPES,
    MalformedPayload,
    ProcessRequest,
    TopicKey,
    marshal,
    payload_type,
    topic_keys,
    unmarshal,
)
from contract import generate as gen

# --- bindings -------------------------------------------------------------------------


def test_every_topic_key_is_bound_to_exactly_one_message() -> None:
    for key in TopicKey:
        bound = [cls for cls in PAYLOAD_TYPES if key in topic_keys(cls)]
        assert len(bound) == 1, f"{key}: {bound}"
        assert payload_type(key) is bound[0]
        assert payload_type(key.value) is bound[0]


def test_every_message_declares_a_valid_topic_key() -> None:
    assert PAYLOAD_TYPES, "no payload messages found"
    for cls in PAYLOAD_TYPES:
        keys = topic_keys(cls)  # raises ContractError on an unknown key
        assert keys, f"{cls.DESCRIPTOR.full_name} declares no topic_keys"
        assert all(isinstance(k, TopicKey) for k in keys)


def test_bindings_match_the_design() -> None:
    assert {k.value: payload_type(k).DESCRIPTOR.name for k in TopicKey} == {
        "ingest": "IngestRequest",
        "process": "ProcessRequest",
        "build": "BuildRequest",
        "buildsignal": "BuildSignal",
        "record": "Record",
    }


def test_a_message_without_the_option_declares_nothing() -> None:
    from google.protobuf import empty_pb2

    assert topic_keys(empty_pb2.Empty) == ()


def test_dlq_naming() -> None:
    assert TopicKey.PROCESS.dlq == "process_dlq"
    assert [k.dlq for k in TopicKey] == [f"{k.value}_dlq" for k in TopicKey]
    for key in TopicKey:
        assert TopicKey.of_dlq(key.dlq) is key
    assert TopicKey.of_dlq("process") is None
    assert TopicKey.of_dlq("nope_dlq") is None


def test_unknown_key_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        payload_type("nope")


# --- round trips ----------------------------------------------------------------------

# Hypothesis' text() never yields lone surrogates, which proto strings cannot hold.
field_text = st.text()


def _is_text(field: Any) -> bool:
    return bool(field.type == field.TYPE_STRING)


@st.composite
def payloads(draw: st.DrawFn) -> Message:
    cls = draw(st.sampled_from(PAYLOAD_TYPES))
    values = {f.name: draw(field_text if _is_text(f) else st.integers(0, 2**32 - 1))
              for f in cls.DESCRIPTOR.fields}
    return cls(**values)


@given(payloads())
def test_every_payload_round_trips(msg: Message) -> None:
    data = marshal(msg)
    assert isinstance(data, bytes)
    back = unmarshal(data, type(msg))
    assert back == msg
    assert marshal(back) == data  # deterministic


@given(payloads())
def test_wire_uses_proto_names_and_omits_defaults(msg: Message) -> None:
    obj = json.loads(marshal(msg))
    expected = {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields
                if getattr(msg, f.name) not in ("", 0)}
    assert obj == expected


def test_wire_is_snake_case() -> None:
    assert marshal(ProcessRequest(id="request/q/1", queue_name="q")) == (
        b'{"id":"request/q/1","queue_name":"q"}'
    )
    assert marshal(ProcessRequest()) == b"{}"


def test_camel_case_json_names_are_accepted() -> None:
    assert unmarshal(b'{"id":"r","queueName":"q"}', ProcessRequest) == ProcessRequest(
        id="r", queue_name="q"
    )


json_scalars = (
    st.none() | st.booleans() | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False) | st.text()
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=8,
)


@given(payloads(), st.dictionaries(st.text(min_size=1), json_values, max_size=4))
def test_unknown_fields_are_ignored(msg: Message, extra: dict[str, Any]) -> None:
    known = {f.name for f in msg.DESCRIPTOR.fields} | {f.json_name for f in msg.DESCRIPTOR.fields}
    obj = json.loads(marshal(msg))
    obj.update({k: v for k, v in extra.items() if k not in known})
    assert unmarshal(json.dumps(obj).encode(), type(msg)) == msg


def test_null_reads_as_default() -> None:
    assert unmarshal(b'{"id":null,"queue_name":"q"}', ProcessRequest) == ProcessRequest(
        queue_name="q"
    )


# --- malformed input ------------------------------------------------------------------


def _only_malformed(data: bytes, cls: type[Message]) -> None:
    """`unmarshal` either succeeds or raises MalformedPayload; any other error fails."""
    with contextlib.suppress(MalformedPayload):
        unmarshal(data, cls)


@given(st.binary(), st.sampled_from(PAYLOAD_TYPES))
def test_arbitrary_bytes_raise_only_malformed_payload(data: bytes, cls: type[Message]) -> None:
    _only_malformed(data, cls)


@given(json_values, st.sampled_from(PAYLOAD_TYPES))
def test_arbitrary_json_raises_only_malformed_payload(value: Any, cls: type[Message]) -> None:
    _only_malformed(json.dumps(value).encode(), cls)


@given(st.sampled_from(PAYLOAD_TYPES), st.data())
def test_wrong_field_types_are_malformed(cls: type[Message], data: st.DataObject) -> None:
    field = data.draw(st.sampled_from(tuple(cls.DESCRIPTOR.fields)))
    name = data.draw(st.sampled_from([field.name, field.json_name]))
    containers = st.lists(st.text(), max_size=2) | st.dictionaries(st.text(), st.text(),
                                                                  max_size=2)
    if _is_text(field):
        bad = data.draw(st.booleans() | st.integers() | st.floats(allow_nan=False)
                        | containers)
    else:  # a number field: not a number, negative, fractional, or too large
        bad = data.draw(st.booleans() | containers | st.integers(max_value=-1)
                        | st.integers(min_value=2**32)
                        | st.floats(0.01, 0.99) | st.text().filter(
                            lambda t: not t.strip().lstrip("+-").isdigit()))
    with pytest.raises(MalformedPayload):
        unmarshal(json.dumps({name: bad}).encode(), cls)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"   ",
        b"\xff\xfe",
        b"\xef\xbb\xbf{}",  # UTF-8 byte-order mark
        b"null",
        b"[]",
        b'["id"]',
        b'"id"',
        b"42",
        b"true",
        b"{",
        b'{"id": "a",}',
        b"{'id': 'a'}",
        b'{"id": NaN}',
        b'{"other": Infinity}',
        b'{"id": "a", "id": "b"}',
        b'{"queue_name": "a", "queueName": "a"}',
        b'{"id": "\\ud800"}',  # lone surrogate escape
        b"[" * 100_000,
        b'{"x":' + b"1" * 5000 + b"}",
    ],
)
def test_malformed_inputs(data: bytes) -> None:
    with pytest.raises(MalformedPayload) as info:
        unmarshal(data, ProcessRequest)
    assert isinstance(info.value, ValueError)
    assert "ProcessRequest" in str(info.value)


# --- generated code -------------------------------------------------------------------


def test_generated_code_is_up_to_date() -> None:
    stale = gen.stale_files()
    assert not stale, f"stale generated files {stale}: run `python -m contract.generate`"


def test_stale_check_notices_edits_and_strays(tmp_path: Path) -> None:
    for path in gen.generated_files(gen.PROTO_DIR):
        shutil.copyfile(path, tmp_path / path.name)
    assert gen.stale_files(tmp_path) == []
    (tmp_path / "messagequeue_pb2.pyi").write_text("# edited\n")
    (tmp_path / "gone_pb2.py").write_text("")
    (tmp_path / "options_pb2.py").unlink()
    assert gen.stale_files(tmp_path) == ["gone_pb2.py", "messagequeue_pb2.pyi", "options_pb2.py"]


def test_generated_code_imports_under_the_installed_runtime() -> None:
    # The gencode's runtime version check ran at import; warnings are errors under pytest.
    assert contract.IngestRequest.DESCRIPTOR.file.name == "contract/pb/messagequeue.proto"
