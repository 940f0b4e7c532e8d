"""Document collections (``aggregate.documents``): JSONL and directory sources, refusals that
name the configuration key (and the document id, never its text), and the keyed partition into
members: disjoint, complete, deterministic for a key and different under another."""

import hashlib
import json

import pytest

from vllm_dp_plugin.aggregate.documents import Collection, Document, load_collection, member_texts

KEY = "aggregate.contexts.notes"


def words(text: str) -> int:
    return len(text.split())


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows),
                    encoding="utf-8")
    return str(path)


def keyed(key: bytes):
    return lambda doc_id: hashlib.sha256(key + doc_id.encode()).digest()


def test_jsonl_ids_text_order_and_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "notes.jsonl", [
        {"id": "memo", "text": "depot closes at six"},
        {"text": "no id: the line number is the id"},
        "",
        {"id": 7, "text": "numeric ids become strings", "extra": "ignored"},
    ])
    coll = load_collection("notes", path)
    assert coll.name == "notes"
    assert coll.documents == (
        Document("memo", "depot closes at six"),
        Document("2", "no id: the line number is the id"),
        Document("7", "numeric ids become strings"),
    )


def test_directory_of_txt_files(tmp_path):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "b.txt").write_text("second by name", encoding="utf-8")
    (folder / "a.txt").write_text("first by name\nwith two lines", encoding="utf-8")
    (folder / "readme.md").write_text("not a document", encoding="utf-8")
    coll = load_collection("notes", folder)
    assert coll.documents == (Document("a", "first by name\nwith two lines"), Document("b", "second by name"))


def test_duplicate_ids_are_refused(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": "x", "text": "one"}, {"id": "x", "text": "two"}])
    with pytest.raises(ValueError, match=rf"{KEY}: document id 'x' appears twice"):
        load_collection("notes", path)
    # an explicit id may collide with another line's implicit one (line 1 -> "1")
    path = write_jsonl(tmp_path / "e.jsonl", [{"text": "one"}, {"id": "1", "text": "two"}])
    with pytest.raises(ValueError, match="document id '1' appears twice"):
        load_collection("notes", path)


def test_empty_sources_are_refused(tmp_path):
    empty_file = tmp_path / "empty.jsonl"
    empty_file.write_text("\n  \n", encoding="utf-8")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    (empty_dir / "skip.md").write_text("x", encoding="utf-8")
    for path in (empty_file, empty_dir):
        with pytest.raises(ValueError, match=rf"{KEY}: .* holds no documents"):
            load_collection("notes", path)


def test_unreadable_sources_are_refused(tmp_path):
    with pytest.raises(ValueError, match=rf"{KEY}: .* is neither a JSONL file nor a directory"):
        load_collection("notes", tmp_path / "missing.jsonl")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, "{not json"])
    with pytest.raises(ValueError, match=rf"{KEY}: .* line 2 is not JSON"):
        load_collection("notes", bad)
    for row in ({"id": "a"}, {"text": 3}, ["text"]):
        path = write_jsonl(tmp_path / "row.jsonl", [row])
        with pytest.raises(ValueError, match=r"line 1 needs a string field `text`"):
            load_collection("notes", path)
    with pytest.raises(ValueError, match=r"^serve\.ctx\.notes: "):
        load_collection("notes", tmp_path / "missing", where="serve.ctx")


def test_over_long_document_is_refused_naming_key_and_id_not_text(tmp_path):
    secret = "the vault code is 4471"
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"id": "short", "text": "three words here"},
        {"id": "doc-7", "text": secret},
    ])
    # at the cap is fine: "three words here" has 3, the secret 5
    assert len(load_collection("notes", path, words, max_document_tokens=5).documents) == 2
    with pytest.raises(ValueError) as info:
        load_collection("notes", path, words, max_document_tokens=4)
    message = str(info.value)
    assert message.startswith(f"{KEY}: document 'doc-7' has 5 tokens")
    assert "max_document_tokens=4" in message
    assert secret not in message and "4471" not in message
    # no counter or no cap: no check
    assert len(load_collection("notes", path, words).documents) == 2
    assert len(load_collection("notes", path, max_document_tokens=1).documents) == 2


def collection(n: int = 40) -> Collection:
    return Collection("c", tuple(Document(f"doc-{i}", f"text {i}") for i in range(n)))


@pytest.mark.parametrize("members", [1, 3, 4, 7])
def test_partition_is_disjoint_complete_and_keeps_source_order(members):
    coll = collection()
    parts = coll.partition(members, keyed(b"deployment-key"))
    assert len(parts) == members
    ids = [d.id for part in parts for d in part]
    assert sorted(ids) == sorted(d.id for d in coll.documents)  # complete
    assert len(ids) == len(set(ids))  # disjoint
    order = {d.id: i for i, d in enumerate(coll.documents)}
    for part in parts:
        assert [order[d.id] for d in part] == sorted(order[d.id] for d in part)
    if members > 1:
        assert sum(1 for part in parts if part) >= 2  # 40 documents do not all land in one


def test_partition_is_deterministic_for_a_key_and_differs_under_another():
    coll = collection()
    first = coll.partition(4, keyed(b"key-A"))
    assert coll.partition(4, keyed(b"key-A")) == first
    assert coll.partition(4, keyed(b"key-B")) != first
    # a document's member depends on its id and the key only, not on the rest of the collection
    alone = Collection("c", (coll.documents[5],)).partition(4, keyed(b"key-A"))
    assert [i for i, p in enumerate(alone) if p] == [i for i, p in enumerate(first) if coll.documents[5] in p]


def test_member_texts_joins_each_members_documents():
    parts = ((Document("a", "one"), Document("b", "two")), (), (Document("c", "three"),))
    assert member_texts(parts) == ["one\ntwo", "", "three"]
    assert member_texts(parts, separator=" | ") == ["one | two", "", "three"]
