"""The member-local key of answer-level aggregation (``aggregate.answer``): paraphrased documents
agree, a member whose document does not state the fact abstains instead of voting for what the
model made up, and another fact of the same document does not vote."""

import pytest

from vllm_dp_plugin.aggregate.answer import answer_key, extract_key, property_words, words

pytest.importorskip("wordfreq")

INSTRUCTION = "Answer the user's question with a short phrase copied from the document above, or NONE."
RIVER = "Which river flows past Pekrok Logistics' main office?"
DOCS = {
    "memo": "Memo: Pekrok Logistics' main office stands on the bank of the Skeltmind River.",
    "email": "Email: The Skeltmind River runs beside Pekrok Logistics' main office.",
    "notes": "Meeting notes: Exactly 2718 employees work for Pekrok Logistics. Pekrok Logistics built its main "
             "office next to the Skeltmind River.",
    "mascot": "Team chat: Children love Kromtrir, the mascot of Pekrok Logistics.",
    "ceo": "Board minutes: Pekrok Logistics' chief executive, Drakbre Skomthu, chairs the weekly meeting.",
    "headcount": "Notice board: Pekrok Logistics employs 2,718 people.",
}


def key(answer: str, doc: str, question: str = RIVER) -> str | None:
    return answer_key(answer, [DOCS[doc]], question, [INSTRUCTION])


def test_paraphrased_documents_agree_on_one_key():
    answers = {"memo": "The Skeltmind River.", "email": "Skeltmind River runs beside the main office",
               "notes": "The main office is next to the Skeltmind River"}
    assert {key(a, d) for d, a in answers.items()} == {"skeltmind river"}


def test_a_made_up_answer_abstains_the_span_check():
    assert key("The Thames River.", "mascot") is None  # not in the member's document
    assert key("NONE", "memo") is None and key("", "memo") is None
    assert key("Pekrok Logistics' main office", "memo") is None  # only the question's own words


def test_another_fact_of_the_document_does_not_vote():
    """The mascot question: a document about the river holds 'Skeltmind' but no sentence of it
    says anything about a mascot, so its member abstains; the mascot's own document votes."""
    mascot = "What is the name of Pekrok Logistics' mascot?"
    assert property_words(mascot) == ["mascot"]  # the names are the subject, "what is the" too common
    assert key("The Skeltmind River", "memo", mascot) is None
    assert key("Kromtrir", "mascot", mascot) == "kromtrir"


def test_a_name_is_one_key_and_numbers_keep_their_digits():
    ceo = "Who is the chief executive of Pekrok Logistics?"
    assert key("The chief executive of Pekrok Logistics is Drakbre Skomthu.", "ceo", ceo) == "drakbre skomthu"
    staff = "How many employees does Pekrok Logistics have?"
    assert key("Pekrok Logistics employs 2,718 people", "headcount", staff) == "2718"  # employs ~ employees
    assert key("Exactly 2718 employees", "notes", staff) == "2718"
    assert key("2,718", "notes", staff) == "2718"


def test_words_are_normalised_and_only_the_first_line_counts():
    assert words("ＳＫＥＬＴＭＩＮＤ River!") == ["skeltmind", "river"]  # NFKC + casefold
    assert key("I don't know.\nThe Skeltmind River", "memo") is None


def test_a_date_keeps_one_number_beside_its_month_however_the_range_is_written():
    doc = ["Memo: the Harlow depot closes for inventory from Quintember 14 to 16."]
    question = "When is the Harlow depot closed for inventory?"
    for answer in ("From Quintember 14 to 16.", "Quintember 14-16", "on Quintember 14th to 16th, 2023"):
        assert answer_key(answer, doc, question, [INSTRUCTION]) == "quintember 14"


SITES = [("Site memo: the Westgate quarterly review is held in Room 12 at 8 am. The Eastgate quarterly review is "
          "held in Room 22."),
         "Refunds: any refund above $500 must be approved by the regional manager.",
         "Visitors: at Westgate, visitors sign in at the west entrance."]


def site_key(answer: str, question: str) -> str | None:
    return answer_key(answer, SITES, question, [INSTRUCTION])


def test_the_phrase_keeps_the_common_words_that_belong_to_the_answer():
    """"Room 12" not "12", "8 am" not "8", "regional manager" not "regional": the phrase grows
    over content words, a label before a number and a unit after one, as long as the documents
    say it that way (a run of one relevant sentence)."""
    room = "In which room is the Westgate quarterly review held?"
    assert site_key("Room 12", room) == "room 12"
    assert site_key("It is held in Room 12.", room) == "room 12"
    assert site_key("At 8 am", "At what time does the Westgate quarterly review start?") == "8 am"
    assert site_key("The regional manager.", "Who must approve a refund above $500?") == "regional manager"
    assert site_key("the west entrance", "Where do visitors sign in at Westgate?") == "west entrance"
    assert site_key("Manager regional", "Who must approve a refund above $500?") == "regional"  # not a run of the document


def test_the_same_property_of_another_subject_does_not_vote():
    """The sentence must name the question's subject: Eastgate's room is not Westgate's."""
    room = "In which room is the Eastgate quarterly review held?"
    assert site_key("Room 22", room) == "room 22"
    assert site_key("Room 22", "In which room is the Westgate quarterly review held?") is None
    assert site_key("Room 12", room) is None  # Westgate's, from the same sentence? no: its own sentence names Westgate


def test_hedges_and_the_questions_own_words_stay_out_of_the_phrase_but_the_noun_it_asks_for_closes_it():
    """"Which river ...?" asks for a river: "river" closes the phrase ("skeltmind river"); other
    words of the question ("employees", "flows past") and hedges stay out."""
    staff = "How many employees does Pekrok Logistics have?"
    assert key("Exactly 2718 employees", "notes", staff) == "2718"
    assert key("The Skeltmind River", "memo") == "skeltmind river"
    assert key("The Skeltmind River flows past the main office", "memo") == "skeltmind river"
    entrance = ["Ticket OPS-4280 — Suppliers deliver to the west entrance of Tralstosport."]
    assert answer_key("the west entrance", entrance, "Which entrance do deliveries use at Tralstosport?") == \
        "west entrance"
    date = ["Plan ahead: On July 11 Lemdoulstead closes for inventory."]  # the subject's name is no kind
    assert answer_key(date[0], date, "When is Lemdoulstead closed for inventory?") == "july 11"


def test_a_common_number_is_the_value_and_its_label_joins_it():
    """"6" is a common word but the value of "On which level ...?": it votes (numbers always do)
    and is the phrase's core over "car" (of "the car park"); "level", the question's own word as
    written, joins it as its label."""
    doc = ["At Vesgresstead, visitor parking is on level 6 of the car park."]
    question = "On which level do visitors park at Vesgresstead?"
    assert answer_key("The level 6 of the car park.", doc, question, [INSTRUCTION]) == "level 6"
    assert answer_key("Level 6", doc, question, [INSTRUCTION]) == "level 6"


# ------------------------------------------------------------------ answer_member: extract
READ = {  # realistic documents: headers, several facts, the asked property also stated for another site
    "policy": "Ref LOG-4068 | Policy: Send travel expense claims from Sorkkukbury to the area coordinator for "
              "approval. Visitors to Sorkkukbury park on level 4 of the car park.",
    "ticket": "Ticket ADM-8041 — Remember that the morning shift at Lorbundale begins at 6:45 am. Visitors to "
              "Thirmisdale must sign in at the front desk.",
    "letter": "Customer letter: Visitors to Vesgresstead park on level 6 of the car park. Visitors to Mikromoor "
              "park on level 2 of the car park.",
    "guests": "Site guide: Guests of Vesgresstead should use level 6 of the garage.",
    "both": "Memo: Visitors to Vesgresstead park on level 6. Visitors to Vesgresstead park on level 3.",
    "team": "Interview: Budget code FN-1793 belongs to the logistics team. Voustilt Stiqua leads the training "
            "team. The training team books its costs to budget code SL-2456.",
}


def extract(doc: str, question: str) -> str | None:
    from vllm_dp_plugin.aggregate.answer import extract_key

    return extract_key([READ[doc]], question)


def test_a_reading_member_votes_the_phrase_of_the_clause_that_answers_not_the_header():
    assert extract("ticket", "What time does the morning shift start at Lorbundale?") == "6 45 am"
    assert extract("policy", "Who approves travel expenses at Sorkkukbury?") == "area coordinator"
    assert extract("letter", "On which level do visitors park at Vesgresstead?") == "level 6"


def test_a_reading_member_abstains_on_another_subject_and_on_two_values():
    assert extract("letter", "On which level do visitors park at Quolgrilbury?") is None  # not its site
    assert extract("ticket", "Who approves travel expenses at Lorbundale?") is None  # not stated
    assert extract("both", "On which level do visitors park at Vesgresstead?") is None  # 6 and 3: no vote
    # a paraphrase sharing one of "level", "visitors", "park" is not enough (all but one): the limit
    assert extract("guests", "On which level do visitors park at Vesgresstead?") is None


def test_a_reading_member_takes_the_clause_holding_most_of_what_is_asked():
    """"training" alone also names the budget-code sentence; "leads" and "training" only the lead's."""
    assert extract("team", "Who leads the training team?") == "voustilt stiqua"


def test_a_reading_member_depends_on_its_own_documents_only():
    """The vote of a member is the same whatever other documents the collection holds: the
    function takes its documents and the public question, nothing else."""
    from vllm_dp_plugin.aggregate.answer import extract_key

    question = "On which level do visitors park at Vesgresstead?"
    assert extract_key([READ["letter"], READ["policy"]], question) == "level 6"
    assert extract_key([READ["letter"], READ["both"]], question) is None  # its own two documents disagree


def test_a_number_word_is_a_value_and_its_unit_joins_it():
    """"two" and "years" are very common words, but "lasts two years" answers "How long ...?": the
    number word votes as a number does, the unit joins it, the verb before it does not."""
    doc = "Warranty card: The warranty on the Grirlou X lasts two years."
    assert extract_key([doc], "How long is the warranty on the Grirlou X?") == "two years"


def test_a_question_naming_no_subject_needs_every_word_that_names_it():
    """"the support team" is lower-case: "support" and "team" are common words, yet another team's
    budget code or meeting day must not answer it (it did: another team's code was released)."""
    doc = ("Board minutes: Budget code LG-5566 belongs to the training team. The support team meets "
           "every Thursday. The training team meets every Friday.")
    assert extract_key([doc], "What is the budget code of the support team?") is None
    assert extract_key([doc], "What is the budget code of the training team?") == "lg 5566"
    assert extract_key([doc], "On which day does the support team meet?") == "thursday"
    assert extract_key([doc], "On which day does the training team meet?") == "friday"


def test_a_number_of_the_question_names_no_property():
    """"What is 9 + 8?" asks nothing of "The Krommorkdale morning shift starts at 8 am" (a public
    question released "krommorkdale starts" noise-free before numbers were left out)."""
    doc = "Site guide: The Krommorkdale morning shift starts at 8 am."
    assert property_words("What is 9 + 8?") == []
    assert answer_key("8 am", [doc], "What is 9 + 8?") is None
    from vllm_dp_plugin.aggregate.answer import extract_key

    assert extract_key([doc], "What is 9 + 8?") is None
    assert extract_key([doc], "When does the morning shift start at Krommorkdale?") == "8 am"


def test_a_lead_in_before_the_question_names_nothing_it_asks():
    """"Quick question: When is ...?" asks "When is ...?": the lead-in's words ("quick",
    "question") are no property every clause must hold (no fact was released for such a question)."""
    from vllm_dp_plugin.aggregate.answer import focus

    doc = "Memo: the Seattle warehouse closes for inventory from September 14 to 16."
    assert focus("Quick question: When is the Seattle warehouse closed for inventory?") == \
        "When is the Seattle warehouse closed for inventory?"
    assert focus("Hi. Who leads the sales team? Thanks") == "Who leads the sales team?"
    for lead in ("", "Quick question: ", "Please tell me: ", "Hello there. "):
        assert extract_key([doc], lead + "When is the Seattle warehouse closed for inventory?") == "september 14"


def test_the_word_before_the_asked_for_noun_is_the_answer_not_the_sentences_rarest():
    """"Which entrance ...?" read from "Suppliers should bring deliveries for X to the south
    entrance": "suppliers" is the clause's rarest word but not what is asked (its member voted
    for it, splitting the fact's votes below the threshold)."""
    question = "Which entrance do deliveries use at Stolbury?"
    for doc in ("Suppliers should bring deliveries for Stolbury to the south entrance.",
                "Drivers delivering to Stolbury must use the south entrance.",
                "Stolbury receives its deliveries at the south entrance."):
        assert extract_key([doc], question) == "south entrance", doc
