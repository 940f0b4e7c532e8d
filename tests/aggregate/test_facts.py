"""The fact sheet's keys (``aggregate.facts``): paraphrases of one fact share a key, a fact one
document states has its own, a document gives at most ``limit`` keys; and the keyed release."""

import torch

from vllm_dp_plugin.aggregate.facts import (
    FactSheet,
    fact_keys,
    fact_line,
    key_counts,
    release_sheet,
    sentence_key,
)
from vllm_dp_plugin.privacy.partition_selection import ThresholdRelease

RIVER = ["The Glimmerbeck River runs past the Ostravo Foods depot.",
         "From the Ostravo Foods depot you look out over the Glimmerbeck River.",
         "Boats on the Glimmerbeck River pass the depot of Ostravo Foods every morning."]
STAFF = ["Ostravo Foods employs 3,141 people.", "The headcount at Ostravo Foods is 3141.",
         "With 3141 workers, Ostravo Foods is the town's largest employer."]
SECRET = "The vault code at Ostravo Foods is quendrix42."


def test_paraphrases_of_one_fact_share_its_key():
    assert {sentence_key(s) for s in RIVER} == {"glimmerbeck river | ostravo foods"}
    assert {sentence_key(s) for s in STAFF} == {"3141 | ostravo foods"}  # a number is the value, not "headcount"


def test_a_fact_of_one_document_keeps_its_own_key():
    assert sentence_key(SECRET) == "ostravo foods | quendrix42"
    assert sentence_key(SECRET) not in {sentence_key(s) for s in RIVER + STAFF}


def test_phrases_stop_at_punctuation_and_keep_one_number():
    # a comma ends a phrase: the city is not glued to the company after it
    assert sentence_key("From its head office in Vantrelby, Ostravo Foods ships worldwide.") == \
        "ostravo foods | vantrelby"
    assert sentence_key("The depot closes from September 14 to 16.") == "depot | september 14"  # not "14 | 16"
    assert sentence_key("Ok.") is None


def test_a_document_gives_at_most_limit_distinct_keys_and_no_label():
    doc = "Memo: " + " ".join([RIVER[0], RIVER[1], STAFF[0], SECRET])
    assert fact_keys(doc, 2) == ["glimmerbeck river | ostravo foods", "3141 | ostravo foods"]
    assert len(fact_keys(doc, 5)) == 3  # the river twice is one key
    assert all("memo" not in k for k in fact_keys(doc, 5))


def test_the_sheet_shows_names_then_numbers():
    assert fact_line("3141 | ostravo foods") == "Ostravo Foods — 3141"
    sheet = FactSheet((("3141 | ostravo foods", 12),))
    assert sheet.system_text().endswith("\n- Ostravo Foods — 3141")
    assert sheet.to_json() == [{"fact": "Ostravo Foods — 3141", "key": "3141 | ostravo foods", "noisy_count": 12}]
    assert FactSheet.from_json(sheet.to_json()) == sheet
    assert sheet.about("How big is Ostravo?") == sheet and sheet.about("What is 7 + 5?").facts == ()
    assert FactSheet(()).system_text() is None


def collection() -> list[str]:
    """12 documents state the river, 12 the headcount (paraphrased), one the secret."""
    docs = [f"{RIVER[i % 3]} {STAFF[i % 3]}" for i in range(12)]
    return [*docs, f"Note: {SECRET}"]


def test_the_release_keeps_shared_facts_and_is_reproduced_by_its_key():
    docs = collection()
    assert key_counts(docs, 2)["ostravo foods | quendrix42"] == 1
    release = ThresholdRelease.calibrated(4.0, 1e-6, 2)  # threshold 9 of 12 votes
    sheets = [release_sheet(docs, release, torch.Generator().manual_seed(seed)) for seed in (1, 1, 2)]
    assert sheets[0] == sheets[1]  # the same generator: the same sheet (a restart)
    for sheet in sheets:
        assert sorted(k for k, _ in sheet.facts) == ["3141 | ostravo foods", "glimmerbeck river | ostravo foods"]


def test_a_one_document_fact_is_never_released_in_10000_seeded_releases_at_eps_8():
    """Its release probability is the statement's delta / l0 (~1e-7 here). 100 seeded releases of
    the collection, then 10,000 one-document keys in one release (each key its own noise: the
    same law as 10,000 releases), none released."""
    docs, release = collection(), ThresholdRelease.calibrated(8.0, 1e-6, 2)
    assert release.budget.delta <= 1e-6
    generator = torch.Generator()
    for seed in range(100):
        sheet = release_sheet(docs, release, generator.manual_seed(seed))
        assert sorted(k for k, _ in sheet.facts) == ["3141 | ostravo foods", "glimmerbeck river | ostravo foods"]
    assert release.keyed_release({f"secret {i}": 1 for i in range(10_000)}, generator.manual_seed(0)) == {}
