"""Document collections (``aggregate.documents``): JSONL and directory sources, refusals that
name the configuration key (and the document id or line, never its text), and the keyed
partition into members: disjoint, complete, deterministic for a key and different under
another, and stable under the unit's neighbours (one document removed or added moves exactly one
member's documents)."""

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
        "",
        {"id": 7, "text": "numeric ids become strings", "extra": "ignored"},
    ])
    coll = load_collection("notes", path)
    assert coll.name == "notes"
    assert coll.documents == (Document("memo", "depot closes at six"), Document("7", "numeric ids become strings"))


@pytest.mark.parametrize("row", [{}, {"id": None}, {"id": ""}, {"id": True}, {"id": 1.5}, {"id": ["a"]}],
                         ids=["missing", "null", "empty", "bool", "float", "list"])
def test_rows_without_an_id_are_refused_naming_file_and_line_not_text(tmp_path, row):
    """A line number as the id would move every later document when one line is removed (the
    old rule): a row without its own id is refused at start-up, naming the file and the line."""
    secret = "the vault code is 4471"
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "text": "fine"}, "", {**row, "text": secret}])
    with pytest.raises(ValueError) as info:
        load_collection("notes", path)
    message = str(info.value)
    assert message.startswith(f"{KEY}: {path} line 3 needs an `id`")
    assert secret not in message and "4471" not in message


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
    # an integer id and its string are the same id
    path = write_jsonl(tmp_path / "e.jsonl", [{"id": 1, "text": "one"}, {"id": "1", "text": "two"}])
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
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"id": "a", "text": "fine"}, "{not json"])
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


ROWS = [{"id": f"note-{i:02d}", "text": f"note {i}"} for i in range(30)]


def members_of(path, key: bytes = b"deployment-key") -> list[list[str]]:
    """Each member's document ids (k = 4) of the collection loaded from ``path``."""
    return [[d.id for d in part] for part in load_collection("notes", path).partition(4, keyed(key))]


def changed_members(before: list[list[str]], after: list[list[str]]) -> list[int]:
    return [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if b != a]


def test_removing_any_one_document_changes_exactly_one_member(tmp_path):
    """The unit's neighbours (remove one line of the JSONL file, any line): exactly one member's
    document list changes, and it is the old list less that document; every other member keeps
    its documents in order. (With line numbers as ids, removing line 1 re-assigned ~3/4 of the
    later documents; a position-based partition fails the same way.)"""
    full = members_of(write_jsonl(tmp_path / "full.jsonl", ROWS))
    assert all(full)  # 30 documents reach every one of the 4 members: the check is not vacuous
    for i, row in enumerate(ROWS):
        less = members_of(write_jsonl(tmp_path / "less.jsonl", ROWS[:i] + ROWS[i + 1:]))
        (moved,) = changed_members(full, less)
        assert row["id"] in full[moved]
        assert less[moved] == [d for d in full[moved] if d != row["id"]]


def test_adding_one_document_anywhere_changes_exactly_one_member(tmp_path):
    """Adding a document (at the start, in the middle, at the end of the file): exactly one
    member changes, and it gains that document and nothing else."""
    full = members_of(write_jsonl(tmp_path / "full.jsonl", ROWS))
    new = {"id": "added", "text": "a new note"}
    for at in (0, 13, len(ROWS)):
        more = members_of(write_jsonl(tmp_path / "more.jsonl", [*ROWS[:at], new, *ROWS[at:]]))
        (moved,) = changed_members(full, more)
        assert [d for d in more[moved] if d != "added"] == full[moved] and "added" in more[moved]


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
