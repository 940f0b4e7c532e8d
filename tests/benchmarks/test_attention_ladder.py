"""`python -m benchmarks.attention_ladder` on a tiny random Llama: ``full`` is the model's own attention,
``block`` encodes documents independently, each row rewrites only the span, and the clustered
row is exact when every key is its own centroid."""

from pathlib import Path

import pytest
import torch

from benchmarks import attention_ladder as ladder

LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2, 4, 2, 8, 64
HEAD, SEGMENTS = 3, [(3, 9), (9, 14), (14, 20)]  # a 3-token public head, then three documents
SPAN = (HEAD, SEGMENTS[-1][1])
SMOLLM2 = Path(".models/smollm2-135m-instruct")


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HEADS * HEAD_DIM, intermediate_size=64,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         head_dim=HEAD_DIM, max_position_embeddings=256)
    model = LlamaForCausalLM(config)
    ladder.prepare(model)
    return model


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def logits_after(model, context: list[int], prompt: list[int], phase: ladder.Phase) -> torch.Tensor:
    """Next-token logits after ``prompt`` read under ``phase`` over ``context`` encoded causally."""
    cache = ladder.encode(model, context, ladder.Phase())
    ladder.PHASE = phase
    try:
        pos = torch.arange(len(context), len(context) + len(prompt))[None]
        with torch.no_grad():
            return model(input_ids=torch.tensor([prompt]), position_ids=pos, past_key_values=cache,
                         use_cache=True).logits[0, -1]
    finally:
        ladder.PHASE = ladder.Phase()


def query(mode: str, **kwargs) -> ladder.Phase:
    return ladder.Phase(kind="query", head=HEAD, span=SPAN, mode=mode, **kwargs)


@pytest.fixture(scope="module")
def stock(model):
    """The same weights with transformers' own eager attention."""
    import copy

    from transformers import LlamaForCausalLM

    stock = LlamaForCausalLM(copy.deepcopy(model.config))  # its own config: the implementation is per config
    stock.load_state_dict(model.state_dict())
    stock.set_attn_implementation("eager")
    stock.eval()
    assert model.config._attn_implementation == ladder.IMPL
    return stock


def test_full_is_the_models_own_attention(model, stock):
    context, prompt = ids(SPAN[1], 1), ids(5, 2)
    with torch.no_grad():
        want = stock(input_ids=torch.tensor([context + prompt])).logits[0, -1]
    assert torch.allclose(logits_after(model, context, prompt, query("full")), want, atol=1e-5)


def test_greedy_answer_matches_generate_and_crops_the_cache(model, stock):
    context, prompt = ids(SPAN[1], 3), ids(4, 4)
    cache = ladder.encode(model, context, ladder.Phase())
    got = ladder.answer(model, cache, prompt, query("full"), 6, stop=set())
    assert cache.get_seq_length() == len(context)
    with torch.no_grad():
        want = stock.generate(torch.tensor([context + prompt]), max_new_tokens=6, do_sample=False,
                              pad_token_id=0)[0, len(context) + len(prompt):].tolist()
    assert got == want


def test_block_encoding_moves_only_the_changed_documents_rows(model):
    a = ids(SPAN[1], 5)
    b = list(a)
    b[10] = (b[10] + 1 - 4) % (VOCAB - 4) + 4  # a token of the second document [9, 14)
    block = ladder.Phase(kind="block", head=HEAD, segments=SEGMENTS)
    ka, kb = ladder.encode(model, a, block), ladder.encode(model, b, block)
    for layer in range(LAYERS):
        diff = (ka.layers[layer].keys - kb.layers[layer].keys).abs().amax((0, 1, 3))  # per position
        moved = (diff > 0).nonzero().flatten().tolist()
        assert set(moved) <= set(range(10, 14)) and 10 in moved
    # causal encoding: every later row moves
    ca, cb = ladder.encode(model, a, ladder.Phase()), ladder.encode(model, b, ladder.Phase())
    assert ((ca.layers[1].keys - cb.layers[1].keys).abs().amax((0, 1, 3))[14:] > 0).all()


def test_dropped_and_uniform_rewrite_only_the_span():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, s, t, HEAD_DIM, generator=g) for s, t in ((HEADS, 2), (KV_HEADS, 22), (KV_HEADS, 22)))
    span = (3, 20)
    full = ladder._query(ladder.Phase(kind="query", head=3, span=span), 0, q, k, v, 0.3)
    dropped = ladder._query(ladder.Phase(kind="query", head=3, span=span, mode="dropped"), 0, q, k, v, 0.3)
    # dropped == exact attention over the head and the tail only
    keep = torch.tensor([*range(3), 20, 21])
    mask = torch.ones(2, 5, dtype=torch.bool).tril(3)
    want = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, keep], v[:, :, keep], attn_mask=mask,
                                                           scale=0.3, enable_gqa=True)
    assert torch.allclose(dropped, want, atol=1e-6)
    assert not torch.allclose(full, dropped, atol=1e-3)
    # uniform: a span whose keys are all equal is already uniform
    k_flat = k.clone()
    k_flat[:, :, 3:20] = k[:, :, 3:4]
    flat = ladder.Phase(kind="query", head=3, span=span)
    assert torch.allclose(ladder._query(flat, 0, q, k_flat, v, 0.3),
                          ladder._query(ladder.Phase(kind="query", head=3, span=span, mode="uniform"),
                                        0, q, k_flat, v, 0.3), atol=1e-6)


def test_clustered_with_the_keys_as_centroids_is_exact_and_taylor_is_exact_at_its_centre():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, s, t, HEAD_DIM, generator=g) for s, t in ((HEADS, 2), (KV_HEADS, 22), (KV_HEADS, 22)))
    span = (3, 20)
    full = ladder._query(ladder.Phase(kind="query", head=3, span=span), 0, q, k, v, 0.3)
    exact = ladder._query(ladder.Phase(kind="query", head=3, span=span, mode="clustered",
                                       replaced={0: k[0, :, 3:20]}), 0, q, k, v, 0.3)
    assert torch.allclose(exact, full, atol=1e-6)
    # every span key equal to the public mean key: the Taylor centre is every logit, T_2(0) = 1
    k_mean = k.clone()
    k_mean[:, :, 3:20] = k[0, :, 3][None, :, None]
    taylor = ladder.Phase(kind="query", head=3, span=span, mode="taylor", mean_key={0: k[0, :, 3]})
    assert torch.allclose(ladder._query(taylor, 0, q, k_mean, v, 0.3),
                          ladder._query(ladder.Phase(kind="query", head=3, span=span), 0, q, k_mean, v, 0.3),
                          atol=1e-6)


def test_kmeans_finds_separated_clusters():
    g = torch.Generator().manual_seed(2)
    centres = torch.tensor([[10.0, 0.0], [-10.0, 0.0], [0.0, 10.0]])
    x = torch.cat([c + 0.1 * torch.randn(200, 2, generator=g) for c in centres])
    found = ladder.kmeans(x, 3, torch.Generator().manual_seed(0))
    assert torch.cdist(centres, found).amin(1).max() < 0.1


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").exists(), reason="needs the imported SmolLM2 (make real-models)")
def test_collection_segments_are_the_documents():
    from transformers import AutoTokenizer

    from vllm_dp_plugin.benchmarks.lib.scenarios import ChatLayout

    layout = ChatLayout(AutoTokenizer.from_pretrained(SMOLLM2))
    docs = ["Memo: Pekrok Logistics employs 2718 people.", "Email: The river is the Skeltmind River.", "FAQ: yes."]
    coll = ladder.collection(layout, {"id": "t", "documents": docs, "questions": []})
    assert coll.head == 3 and coll.segments[0][0] == coll.head and coll.segments[-1][1] == len(coll.ids)
    assert all(a[1] == b[0] for a, b in zip(coll.segments, coll.segments[1:], strict=False))
    for (s, e), doc in zip(coll.segments, docs, strict=True):
        assert layout.tokenizer.decode(coll.ids[s:e]).startswith(doc)


class CharTokenizer:
    """Public text as ids of the tiny model's vocabulary (one id per character)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [4 + ord(c) % (VOCAB - 4) for c in text[:20_000]]


def test_public_keys_give_the_taylor_centre_and_centroids_per_layer_and_kv_head(model):
    public = ladder.public_keys(model, CharTokenizer(), [1, 2, 3], 400, (4,))
    assert set(public.mean) == set(public.centroids[4]) == set(range(LAYERS))
    for layer in range(LAYERS):
        assert public.mean[layer].shape == (KV_HEADS, HEAD_DIM)
        assert public.centroids[4][layer].shape == (KV_HEADS, 4, HEAD_DIM)
    again = ladder.public_keys(model, CharTokenizer(), [1, 2, 3], 400, (4,))  # seeded: reproducible
    assert torch.equal(public.centroids[4][1], again.centroids[4][1])
