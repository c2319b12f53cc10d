"""The Responses store without a server: bounds in entries and bytes, oldest first, tenants apart."""

from __future__ import annotations

from typing import Any

from specserve.server.response_store import ResponseStore, json_size

CONVERSATION = [{"type": "message", "role": "user", "content": "hi"}]


def body(response_id: str, text: str = "") -> dict[str, Any]:
    return {"id": response_id, "object": "response", "text": text}


def test_entries_are_bounded_and_the_oldest_goes_first() -> None:
    store = ResponseStore(max_entries=2, max_bytes=1 << 20)
    for i in range(3):
        assert store.put("t", f"r{i}", body(f"r{i}"), CONVERSATION)
    assert store.get("t", "r0") is None and len(store) == 2 and store.evicted == 1
    entry = store.get("t", "r2")
    assert entry is not None and entry.response == body("r2") and entry.conversation == CONVERSATION
    assert store.get("t", "r1") is not None  # a read does not make an entry younger
    store.put("t", "r3", body("r3"), CONVERSATION)
    assert store.get("t", "r1") is None and store.get("t", "r2") is not None


def test_bytes_are_bounded() -> None:
    size = json_size(body("a", "x" * 100), CONVERSATION)
    store = ResponseStore(max_entries=100, max_bytes=2 * size + 10)
    for name in "abc":
        assert store.put("t", name, body(name, "x" * 100), CONVERSATION)
        assert store.bytes <= store.max_bytes
    assert store.get("t", "a") is None and store.get("t", "b") is not None and store.bytes == 2 * size
    assert not store.put("t", "huge", body("huge", "x" * 1000), CONVERSATION)  # larger than the bound
    assert store.get("t", "huge") is None and len(store) == 2  # and it evicted nothing


def test_tenants_are_apart_and_delete_frees_bytes() -> None:
    store = ResponseStore(max_entries=10, max_bytes=1 << 20)
    store.put("key-a", "r", body("r", "a"), CONVERSATION)
    assert store.get("key-b", "r") is None and not store.delete("key-b", "r")
    store.put("key-b", "r", body("r", "b"), CONVERSATION)  # the same id under another key is another entry
    entry = store.get("key-a", "r")
    assert entry is not None and entry.response["text"] == "a"
    assert store.delete("key-a", "r") and store.get("key-a", "r") is None and not store.delete("key-a", "r")
    assert len(store) == 1 and store.bytes == json_size(body("r", "b"), CONVERSATION)


def test_replacing_an_id_and_a_store_of_nothing() -> None:
    store = ResponseStore(max_entries=2, max_bytes=1 << 20)
    store.put("t", "r", body("r", "old"), CONVERSATION)
    store.put("t", "r", body("r", "new"), CONVERSATION)
    entry = store.get("t", "r")
    assert len(store) == 1 and entry is not None and entry.response["text"] == "new"
    empty = ResponseStore(max_entries=0, max_bytes=1 << 20)
    assert not empty.put("t", "r", body("r"), CONVERSATION) and len(empty) == 0
