"""The private context's layout: the public head (the tokens every system turn starts with stay
public and exact) and unit document (fixed slots, documents encoded independently)."""

import pytest

from tests.models.test_serve_real import REPO, real_model
from vllm_dp_plugin.config import ConfigError
from vllm_dp_plugin.serving.context import head_length, public_head_ids, tokenize_context


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(real_model("smollm2-135m-instruct")))


def test_auto_finds_the_chatml_system_header_of_a_real_tokenizer(smollm2_tokenizer):
    header = public_head_ids(smollm2_tokenizer)
    assert smollm2_tokenizer.convert_ids_to_tokens(list(header)) == ["<|im_start|>", "system", "Ċ"]
    text = (REPO / "examples/private_context_chatml.txt").read_text()
    ids = tokenize_context(text, smollm2_tokenizer)
    assert head_length(ids, "auto", header, "k") == 3
    assert head_length(tokenize_context("Internal notes: none.", smollm2_tokenizer), "auto", header, "k") == 0


def test_a_declared_head_is_taken_as_is_and_must_leave_a_private_token():
    assert head_length([5, 6, 7], 2, (1,), "k") == 2
    assert head_length([5, 6, 7], 0, (5,), "k") == 0
    with pytest.raises(ConfigError, match="public_head=3 leaves no private token"):
        head_length([5, 6, 7], 3, (), "attention.private_context")


# ----------------------------------------------------------------------------- unit document
DOCS = ["The depot opens at nine.", "Our courier is Veltrup Freight.", "Invoices are due in 30 days."]


def test_documents_are_laid_out_in_fixed_slots_inside_the_system_turn(smollm2_tokenizer):
    from vllm_dp_plugin.serving.context import document_layout

    layout = document_layout(DOCS, smollm2_tokenizer, 16, "attention.private_context")
    assert (layout.head, layout.end, layout.slot) == (3, 3 + 3 * 16, 16)
    text = smollm2_tokenizer.decode(list(layout.ids))
    assert text.startswith("<|im_start|>system\nThe depot opens at nine.\n\n") and text.endswith("<|im_end|>\n")
    second = smollm2_tokenizer.decode(list(layout.ids[3 + 16 : 3 + 32]))
    assert second.startswith("Our courier is Veltrup Freight.\n") and set(second[31:]) == {"\n"}
    with pytest.raises(ConfigError, match=r"attention.private_context: document 2 has \d+ tokens .*document_tokens is 7"):
        document_layout(DOCS, smollm2_tokenizer, 7, "attention.private_context")


SLOT = 32  # the demo tokenizer's small vocabulary spends more tokens per word


def documents_job(model, tmp, documents):
    import json

    from .engines import dp_section

    path = tmp / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    section = dp_section(tmp, 1.0, private_context=str(path), unit="document", document_tokens=SLOT)
    section["key_file"] = str(tmp / "noise.key")
    return {"model": model, "llm": {"tokenizer_mode": "dp_private", "additional_config": {"dp_privacy": section}},
            "steps": [{"prompts": ["Where is the depot?"], "max_tokens": 2}, {"private_rows": True}]}


@pytest.mark.vllm
def test_changing_one_document_changes_only_its_own_rows_in_the_cached_kv(tmp_path):
    """Two deployments whose collections differ in document 2 (of 3): in every layer the cached
    K/V rows of documents 1 and 3 are identical, document 2's SLOT rows differ (block attention:
    each document's rows see the public head and the document only)."""
    import torch

    from vllm_dp_plugin.demo import make_demo_llama

    from .engines import run_engine

    model = str(make_demo_llama(tmp_path / "llama"))
    key = bytes(range(32))
    rows = []
    for i, docs in enumerate((DOCS, [DOCS[0], "Returns go to the Tacoma hub.", DOCS[2]])):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "noise.key").write_bytes(key)
        (tmp_path / str(i) / "noise.key").chmod(0o600)
        result = run_engine(documents_job(model, tmp_path / str(i), docs))
        (worker,) = result[1]["private_rows"]
        rows.append(worker)
    assert rows[0].keys() == rows[1].keys() and len(rows[0]) >= 2
    for name in rows[0]:
        for a, b in zip(rows[0][name], rows[1][name], strict=True):  # K, then V: [3 SLOT, H, d]
            a, b = torch.tensor(a), torch.tensor(b)
            assert a.shape[0] == 3 * SLOT
            moved = (a != b).flatten(1).any(dim=1)
            assert moved[SLOT : 2 * SLOT].any() and not moved[:SLOT].any() and not moved[2 * SLOT :].any(), name
