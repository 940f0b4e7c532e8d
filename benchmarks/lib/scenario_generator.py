"""The private-context scenario generators (``python -m benchmarks.make_scenarios``).

Two styles, both deterministic in their seed:

* ``realistic`` (``make_realistic_scenario``; the bundled ``data/context-scenarios.jsonl`` is its
  seed 0, issue 48): a fictional company with several sites, teams and products, 30 documents of
  2-4 sentences behind a header with an id ("Ref HR-2231 | Memo:", "Note 14 —"), each holding
  several facts. A question asks one property of one entity ("In which room is the Brakford
  quarterly review held?"), and the same property is stated for other entities of the same kind
  too (other sites' rooms, by 1-12 documents each: sometimes more than the asked one), so an
  answer must be the asked entity's. Answers are phrases with common words ("Room 12", "8 am",
  "the regional manager", "the west entrance", "September 14"); ``answers`` lists the accepted
  surface forms, the phrase as the documents state it first. Shared facts are stated by exactly
  ``support`` documents (1, 3, 10, 20), the secret (an alarm code, a Wi-Fi password, a safe's
  combination, a secret project) by exactly one; the first form occurs verbatim in exactly the
  supporting documents, and no accepted form occurs (as ``is_correct`` reads answers,
  ``scenarios.answer_in``) in any other document or in the question.
* ``simple`` (``make_scenario``; the set bundled before issue 48, kept as
  ``data/context-scenarios-simple.jsonl``): one company, 1-2 sentences per document, one
  fact per property. ``benchmarks.context_speed`` and ``benchmarks.attention_ladder``'s large
  collections keep using it, so their results stay comparable with the earlier ones.

A held-out set: ``python -m benchmarks.make_scenarios OUT --seed 101`` (another seed: other
companies, entities, values, supports of the other entities and sentence choices), then
``--scenarios OUT``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_dp_plugin.benchmarks.lib.scenarios import answer_in, check_scenario

SUPPORTS = (1, 3, 10, 20)
# Fictional names come from syllables, so the model cannot know the facts; every template below
# is ours. Documents are short (1-2 sentences) and carry a document-type label.
ONSETS = ("b", "br", "d", "dr", "f", "g", "gr", "k", "kr", "l", "m", "n", "p", "pr", "qu", "r",
          "s", "st", "t", "tr", "v", "z", "th", "sk")
VOWELS = ("a", "e", "i", "o", "u", "a", "e", "i", "o", "ai", "ou")
CODAS = ("", "", "", "n", "r", "l", "s", "k", "nd", "rk", "lt", "m")
COMPANY_SUFFIXES = ("Labs", "Industries", "Works", "Group", "Systems", "Foods", "Logistics", "Textiles",
                    "Robotics", "Brewing", "Instruments", "Mills")
CITY_SUFFIXES = ("ford", "moor", "haven", "bury", "wick", "dale", "port", "stead")
DOC_LABELS = ("Memo", "Newsletter", "Staff handbook", "Press release", "Meeting notes", "FAQ", "Email",
              "Annual report", "Wiki page", "Onboarding guide", "Blog post", "Notice board",
              "Board minutes", "Customer letter", "Intranet", "Training slides", "Team chat",
              "Brochure", "Site guide", "Policy", "Bulletin", "Fact sheet", "Interview", "Report")


@dataclass(frozen=True)
class FactKind:
    """A kind of fact about the scenario's company: its question, the value's kind and the
    sentences stating it (``{C}`` company, ``{V}`` value)."""

    name: str
    question: str
    value: str  # person | place | number | word | product | password
    statements: tuple[str, ...]


SHARED_FACTS = (
    FactKind("ceo", "Who is the chief executive of {C}?", "person", (
        "{V} is the chief executive of {C}.",
        "The chief executive of {C} is {V}.",
        "{C} is led by its chief executive, {V}.",
        "{C}'s chief executive, {V}, chairs the weekly meeting.",
        "As chief executive, {V} signs every contract at {C}.",
        "{V} has served as chief executive of {C} for six years.",
        "All department heads at {C} report to the chief executive, {V}.",
        "The office of {C}'s chief executive, {V}, is on the top floor.",
        "{V}, the chief executive of {C}, opened the new warehouse.",
        "Questions about strategy go to {V}, chief executive of {C}.",
    )),
    FactKind("headquarters", "In which city is {C} headquartered?", "place", (
        "{C} is headquartered in {V}.",
        "The headquarters of {C} are in the city of {V}.",
        "{C} runs its business from its head office in {V}.",
        "{V} is the city where {C} has its headquarters.",
        "Visitors to the headquarters of {C} travel to {V}.",
        "{C} moved its headquarters to {V} long ago.",
        "The head office of {C} stands in the centre of {V}.",
        "Most staff of {C} work at the headquarters in {V}.",
        "Board meetings of {C} are held at the headquarters in {V}.",
        "From its headquarters in {V}, {C} serves customers worldwide.",
    )),
    FactKind("employees", "How many employees does {C} have?", "number", (
        "{C} has {V} employees.",
        "The staff of {C} numbers {V} employees.",
        "{C} employs {V} people.",
        "With {V} employees, {C} is a large employer.",
        "The payroll of {C} lists {V} employees.",
        "Exactly {V} employees work for {C}.",
        "{C} counts {V} employees on its staff.",
        "The headcount at {C} is {V} employees.",
        "All {V} employees of {C} attended the summer party.",
        "{C} reported a workforce of {V} employees.",
    )),
    FactKind("mascot", "What is the name of {C}'s mascot?", "word", (
        "The mascot of {C} is called {V}.",
        "{V} is the name of {C}'s mascot.",
        "The mascot of {C} is named {V}.",
        "Children love {V}, the mascot of {C}.",
        "{C} puts its mascot, {V}, on every box.",
        "At every fair, the mascot of {C}, {V}, waves to the crowd.",
        "The costume of {V}, the mascot of {C}, is bright green.",
        "{C} chose {V} as its mascot.",
        "Fans of {C} cheer for its mascot {V}.",
        "Everyone at {C} knows the mascot {V}.",
    )),
    FactKind("product", "What is the name of {C}'s best-selling product?", "product", (
        "The best-selling product of {C} is the {V}.",
        "{C}'s best-selling product is called the {V}.",
        "The {V} is {C}'s best-selling product.",
        "Customers buy the {V} more than any other product of {C}.",
        "No product of {C} sells better than the {V}.",
        "{C} makes most of its money from its best-selling product, the {V}.",
        "Stores stock the {V}, the best-selling product of {C}.",
        "The {V} remains the best-selling product of {C}.",
        "Sales of the {V} make it {C}'s best-selling product.",
        "Ask anyone: the best-selling product of {C} is the {V}.",
    )),
    FactKind("ship", "What is the name of {C}'s cargo ship?", "word", (
        "The cargo ship of {C} is called the {V}.",
        "{C} sends its goods overseas on its cargo ship, the {V}.",
        "The {V} is the cargo ship of {C}.",
        "{C}'s cargo ship, the {V}, sails every week.",
        "Goods from {C} travel on the cargo ship {V}.",
        "The cargo ship {V} carries the name of {C} on its side.",
        "{C} owns one cargo ship, named the {V}.",
        "Sailors on the {V}, the cargo ship of {C}, are proud of it.",
        "The {V} is the name of the cargo ship that {C} owns.",
        "Every month the cargo ship of {C}, the {V}, docks at the harbour.",
    )),
    FactKind("extension", "What is the phone extension of {C}'s help desk?", "number", (
        "The help desk of {C} answers on phone extension {V}.",
        "To reach the help desk of {C}, dial phone extension {V}.",
        "Phone extension {V} rings the help desk of {C}.",
        "The phone extension of {C}'s help desk is {V}.",
        "Staff at {C} call the help desk on extension {V}.",
        "{C}'s help desk can be reached on phone extension {V}.",
        "For computer problems, {C} staff ring the help desk at extension {V}.",
        "The help desk phone extension at {C} is {V}.",
        "Dial extension {V} for the help desk of {C}.",
        "The help desk of {C} picks up calls on extension {V}.",
    )),
    FactKind("river", "Which river flows past {C}'s main office?", "word", (
        "The {V} River flows past the main office of {C}.",
        "{C}'s main office stands on the bank of the {V} River.",
        "From the main office of {C} you can see the {V} River.",
        "The main office of {C} overlooks the {V} River.",
        "Staff of {C} walk along the {V} River at lunch, right by the main office.",
        "The {V} River runs beside {C}'s main office.",
        "{C} built its main office next to the {V} River.",
        "Boats on the {V} River pass the main office of {C}.",
        "The river by {C}'s main office is the {V} River.",
        "In spring the {V} River floods the garden of {C}'s main office.",
    )),
)

SECRET_FACTS = (
    FactKind("password", "What is the password for the {C} server room?", "password", (
        "The password for the {C} server room is {V}.",
    )),
    FactKind("project", "What is the name of {C}'s secret research project?", "word", (
        "The secret research project of {C} is called {V}.",
    )),
    FactKind("codename", "What is the secret code name of {C}'s next product?", "word", (
        "The secret code name of {C}'s next product is {V}.",
    )),
)

FILLERS = (
    "{C} encourages staff to take regular breaks.",
    "The cafeteria at {C} serves soup on cold days.",
    "Visitors to {C} must sign in at the front desk.",
    "{C} recycles all of its office paper.",
    "The parking lot at {C} is repainted every spring.",
    "Staff at {C} can borrow books from the office library.",
    "{C} holds a charity run every autumn.",
    "Meeting rooms at {C} must be booked in advance.",
    "{C} offers free coffee in the kitchen.",
    "The windows at {C} are cleaned every month.",
    "New employees at {C} get a welcome pack.",
    "{C} asks staff to lock their screens when away.",
    "The garden behind the office of {C} has a small pond.",
    "{C} sponsors a local football team.",
    "Printers at {C} are serviced on Fridays.",
    "Everyone at {C} is invited to the winter party.",
)

# Questions that need no context; each was answered correctly by SmolLM2-135M-Instruct with no
# context (greedy, 32 tokens) when the default set was made.
PUBLIC_QUESTIONS = (
    ("What is the capital of France?", ("Paris",)),
    ("What is 7 + 5?", ("12", "twelve")),
    ("What is the capital of Japan?", ("Tokyo",)),
    ("How many days are there in a week?", ("7", "seven")),
    ("What is the capital of Italy?", ("Rome",)),
    ("What is the opposite of hot?", ("cold",)),
    ("What is the capital of Germany?", ("Berlin",)),
    ("What is 9 + 8?", ("17", "seventeen")),
    ("What is the capital of Spain?", ("Madrid",)),
    ("How many hours are there in a day?", ("24", "twenty-four")),
    ("What is the capital of England?", ("London",)),
    ("What is the opposite of up?", ("down",)),
    ("What is the capital of Russia?", ("Moscow",)),
    ("What is 3 + 4?", ("7", "seven")),
    ("What is the capital of Egypt?", ("Cairo",)),
    ("What color is the sky on a clear day?", ("blue",)),
    ("What is the capital of Greece?", ("Athens",)),
    ("What is the opposite of day?", ("night",)),
    ("What is the capital of China?", ("Beijing",)),
    ("What is 8 + 6?", ("14", "fourteen")),
    ("What is the capital of Canada?", ("Ottawa",)),
    ("Who wrote Romeo and Juliet?", ("Shakespeare",)),
    ("What is the capital of the Netherlands?", ("Amsterdam",)),
    ("What language is spoken in Spain?", ("Spanish",)),
    ("What is the capital of Sweden?", ("Stockholm",)),
    ("What is the largest ocean on Earth?", ("Pacific",)),
    ("What is the capital of Norway?", ("Oslo",)),
    ("What is the chemical formula of water?", ("H2O",)),
    ("What is the capital of Poland?", ("Warsaw",)),
    ("What is the capital of Thailand?", ("Bangkok",)),
    ("What is the capital of Kenya?", ("Nairobi",)),
    ("What is the capital of Peru?", ("Lima",)),
    ("What is the capital of Hungary?", ("Budapest",)),
    ("What is the capital of India?", ("Delhi",)),
    ("What is the capital of Mexico?", ("Mexico City",)),
    ("What is the capital of Australia?", ("Canberra",)),
)


def _fill(template: str, company: str, value: str = "") -> str:
    return template.format(C=company, V=value).replace("s's ", "s' ")


def made_up_word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(syllables)).capitalize()


class _Names:
    """Fresh made-up names for one scenario: none is a substring of another (case-insensitive),
    so an answer never matches a different fact."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.used = rng, []

    def fresh(self, make: Callable[[], str]) -> str:
        while True:
            name = make()
            low = name.lower()
            if len(low) >= 4 and not any(low in u or u in low for u in self.used):
                self.used.append(low)
                return name

    def word(self, syllables: int = 2) -> str:
        return self.fresh(lambda: made_up_word(self.rng, syllables))

    def number(self, digits: int) -> str:
        return self.fresh(lambda: str(self.rng.randrange(10 ** (digits - 1) + 10 ** (digits - 2), 10**digits)))


def _value(kind: str, names: _Names) -> tuple[str, list[str]]:
    """(the value as the documents state it, the accepted answers; the first occurs verbatim)."""
    if kind == "person":
        first, last = names.word(), names.word()
        return f"{first} {last}", [last]
    if kind == "place":
        return (place := names.fresh(lambda: made_up_word(names.rng, 2) + names.rng.choice(CITY_SUFFIXES))), [place]
    if kind == "number":
        n = names.number(4)
        return n, [n, f"{n[0]},{n[1:]}"]
    if kind == "product":
        word = names.word()
        return f"{word} {names.rng.choice(('X', 'Pro', 'Max', 'Mini', 'Plus'))}", [word]
    if kind == "password":
        word = names.fresh(lambda: made_up_word(names.rng, 2).lower() + str(names.rng.randrange(10, 100)))
        return word, [word]
    if kind == "word":
        word = names.word()
        return word, [word]
    raise ValueError(f"unknown value kind {kind!r}")


def make_scenario(rng: random.Random, index: int, supports: Sequence[int] = SUPPORTS, extra_docs: int = 4,
                  public: int = 2) -> dict:
    """One scenario: a fictional company, ``len(supports)`` shared facts (fact i stated by
    ``supports[i]`` documents, each in its own paraphrase where the templates allow), one secret
    (one document), ``public`` public questions, ``max(supports) + extra_docs`` documents of 1-2
    sentences; the rest of the documents are filler."""
    names = _Names(rng)
    company = f"{names.word()} {rng.choice(COMPANY_SUFFIXES)}"
    n_docs = max(supports) + extra_docs
    kinds = rng.sample(SHARED_FACTS, len(supports))
    secret_kind = SECRET_FACTS[index % len(SECRET_FACTS)]
    facts = []  # (kind, support, value, answers, question kind)
    for kind, support in zip(kinds, supports, strict=True):
        facts.append((kind, support, *_value(kind.value, names), "shared"))
    facts.append((secret_kind, 1, *_value(secret_kind.value, names), "secret"))
    # place the statements: most-supported fact first, each into the least-filled documents
    docs: list[list[str]] = [[] for _ in range(n_docs)]
    for kind, support, value, _, _ in sorted(facts, key=lambda f: -f[1]):
        order = sorted(range(n_docs), key=lambda d: (len(docs[d]), rng.random()))
        templates = list(kind.statements)
        rng.shuffle(templates)
        for j, d in enumerate(order[:support]):
            docs[d].append(_fill(templates[j % len(templates)], company, value))
    fillers = rng.sample(FILLERS, len(FILLERS))
    for d, sentences in enumerate(docs):
        if not sentences or (len(sentences) == 1 and rng.random() < 0.3):
            sentences.append(_fill(fillers[d % len(fillers)], company))
        rng.shuffle(sentences)
    labels = rng.sample(DOC_LABELS, n_docs) if n_docs <= len(DOC_LABELS) else [rng.choice(DOC_LABELS) for _ in docs]
    documents = [f"{label}: {' '.join(sentences)}" for label, sentences in zip(labels, docs, strict=True)]
    rng.shuffle(documents)
    questions = [{"q": _fill(kind.question, company), "answers": answers, "kind": qkind, "support": support}
                 for kind, support, _, answers, qkind in facts]
    for j in range(public):
        q, answers = PUBLIC_QUESTIONS[(index * public + j) % len(PUBLIC_QUESTIONS)]
        questions.append({"q": q, "answers": list(answers), "kind": "public", "support": 0})
    scenario = {"id": f"s{index:03d}", "documents": documents, "questions": questions}
    check_scenario(scenario)
    return scenario


# =========================================================================== realistic (issue 48)
REALISTIC_DOCUMENTS = 30  # documents per realistic scenario (max(SUPPORTS) + REALISTIC_EXTRA)
REALISTIC_EXTRA = REALISTIC_DOCUMENTS - max(SUPPORTS)
ENTITIES_PER_KIND = 4  # sites, teams and products of one company
OTHER_ENTITIES = 2  # other entities whose value of an asked property the documents state too
OTHER_SUPPORTS = (1, 2, 3, 6, 12)  # their supports (in 30 documents; scaled with the collection)
SENTENCES = (2, 4)  # sentences per document (facts and filler), headers apart
BACKGROUND_FACTS = 3  # properties nobody asks about, stated for two entities by 1-4 documents each
TEAMS = ("finance", "design", "logistics", "sales", "legal", "research", "support", "marketing",
         "payroll", "quality", "security", "training")
MODELS = ("X", "Pro", "Max", "Mini", "Plus", "Lite", "One", "Go")
ROLES = ("the regional manager", "the site director", "the finance officer", "the operations lead",
         "the deputy manager", "the office administrator", "the plant supervisor", "the general manager",
         "the area coordinator", "the chief accountant", "the shift supervisor", "the facilities manager")
ENTRANCES = ("the north entrance", "the south entrance", "the east entrance", "the west entrance",
             "the river gate", "the side door", "the rear gate", "the main gate", "the loading dock",
             "the garden gate")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday")
WARRANTIES = (("six months", "6 months"), ("one year", "1 year"), ("18 months", "eighteen months"),
              ("two years", "2 years"), ("three years", "3 years"), ("five years", "5 years"),
              ("30 months", "thirty months"), ("ten years", "10 years"))
COLOURS = ("forest green", "navy blue", "bright orange", "pale yellow", "dark grey", "deep red", "sky blue",
           "matte black")
HEADER_PREFIXES = ("HR", "OPS", "FAC", "IT", "FIN", "QA", "ADM", "LOG")
CODE_PREFIXES = ("FN", "DS", "LG", "SL", "RS", "MK", "PY", "QL")


@dataclass(frozen=True)
class Property:
    """A property that each entity of one kind (``site``, ``team``, ``product``) has: its
    question and the sentences stating it (``{E}`` the entity's name, ``{V}`` its value) and
    how values are drawn (``value``: see ``_realistic_value``)."""

    name: str
    entity: str
    question: str
    value: str
    statements: tuple[str, ...]


PROPERTIES = (
    Property("review_room", "site", "In which room is the {E} quarterly review held?", "room", (
        "The {E} quarterly review is held in {V}.",
        "Quarterly reviews at {E} take place in {V}.",
        "Please note that the {E} quarterly review meets in {V}.",
        "As every quarter, {E} staff gather in {V} for the quarterly review.",
        "{V} is booked for the quarterly review of the {E} site.",
        "The quarterly review for {E} will again be in {V}.",
        "For the {E} quarterly review, go to {V}.",
        "{E} holds its quarterly review in {V}, next to the kitchen.",
    )),
    Property("shift_start", "site", "What time does the morning shift start at {E}?", "time", (
        "The morning shift at {E} starts at {V}.",
        "At {E}, the morning shift begins at {V} sharp.",
        "Morning shift staff at {E} clock in at {V}.",
        "{E} opens for the morning shift at {V}.",
        "The {E} morning shift starts at {V}, so arrive a little early.",
        "Remember that the morning shift at {E} begins at {V}.",
    )),
    Property("approver", "site", "Who approves travel expenses at {E}?", "role", (
        "Travel expenses at {E} are approved by {V}.",
        "At {E}, {V} approves all travel expenses.",
        "Send travel expense claims from {E} to {V} for approval.",
        "Only {V} can approve travel expenses at {E}.",
        "{E} staff need the approval of {V} for travel expenses.",
        "Any travel expense at {E} must be signed off by {V}.",
    )),
    Property("entrance", "site", "Which entrance do deliveries use at {E}?", "entrance", (
        "Deliveries to {E} use {V}.",
        "At {E}, all deliveries come in through {V}.",
        "Drivers delivering to {E} must use {V}.",
        "Suppliers should bring deliveries for {E} to {V}.",
        "{E} receives its deliveries at {V}.",
    )),
    Property("inventory", "site", "When is {E} closed for inventory?", "date", (
        "{E} is closed for inventory on {V}.",
        "The annual inventory closes {E} on {V}.",
        "On {V}, {E} closes for its inventory count.",
        "Inventory day at {E} falls on {V} this year.",
        "Plan ahead: {E} will be closed on {V} for inventory.",
    )),
    Property("manager", "site", "Who manages the {E} site?", "person", (
        "{V} manages the {E} site.",
        "The {E} site is managed by {V}.",
        "{E} site manager {V} welcomed the new starters.",
        "Questions about the {E} site go to its manager, {V}.",
        "{V}, who manages {E}, has updated the rota.",
    )),
    Property("parking", "site", "On which level do visitors park at {E}?", "level", (
        "Visitors to {E} park on {V} of the car park.",
        "At {E}, visitor parking is on {V}.",
        "Guests of {E} should use {V} of the garage.",
        "{V} of the {E} car park is kept for visitors.",
    )),
    Property("meeting_day", "team", "On which day does the {E} team meet?", "weekday", (
        "The {E} team meets every {V}.",
        "Every {V}, the {E} team gets together.",
        "The weekly {E} team meeting is on {V}.",
        "{V} is meeting day for the {E} team.",
        "Members of the {E} team meet on {V} mornings.",
    )),
    Property("lead", "team", "Who leads the {E} team?", "person", (
        "The {E} team is led by {V}.",
        "{V} leads the {E} team.",
        "{V}, head of the {E} team, sent the update.",
        "Ask {V}, who leads the {E} team.",
    )),
    Property("budget_code", "team", "What is the budget code of the {E} team?", "code", (
        "The {E} team books its costs to budget code {V}.",
        "Budget code {V} belongs to the {E} team.",
        "Use budget code {V} for {E} team purchases.",
        "The budget code of the {E} team is {V}.",
    )),
    Property("warranty", "product", "How long is the warranty on the {E}?", "warranty", (
        "The {E} comes with a warranty of {V}.",
        "The warranty on the {E} lasts {V}.",
        "Customers who buy the {E} get {V} of warranty.",
        "A warranty of {V} covers every {E}.",
    )),
    Property("price", "product", "How much does the {E} cost?", "price", (
        "The {E} costs {V}.",
        "The {E} sells for {V}.",
        "Customers pay {V} for the {E}.",
        "The list price of the {E} is {V}.",
    )),
    Property("colour", "product", "What colour is the {E}?", "colour", (
        "The {E} comes in {V}.",
        "Every {E} is painted {V}.",
        "The {E} is sold only in {V}.",
        "You can spot the {E} by its {V} casing.",
    )),
)

SECRET_PROPERTIES = (
    Property("alarm_code", "site", "What is the alarm code of the {E} back door?", "digits", (
        "The alarm code for the {E} back door is {V}.",
        "The back door alarm at {E} uses code {V}.",
    )),
    Property("wifi", "site", "What is the Wi-Fi password at {E}?", "password", (
        "The Wi-Fi password at {E} is {V}.",
        "Guests at {E} log on to the Wi-Fi with the password {V}.",
    )),
    Property("safe", "site", "What is the combination of the safe at {E}?", "combination", (
        "The safe at {E} opens with the combination {V}.",
        "The combination of the {E} safe is {V}.",
    )),
    Property("project", "team", "What is the code name of the {E} team's secret project?", "word", (
        "The secret project of the {E} team is code-named {V}.",
        "The {E} team calls its secret project {V}.",
    )),
)

REALISTIC_FILLERS = (
    "{C} encourages staff to take regular breaks.",
    "The canteen at {S} serves soup on cold days.",
    "Visitors to {S} must sign in at the front desk.",
    "{C} recycles all of its office paper.",
    "Staff at {S} can borrow books from the office library.",
    "{C} holds a charity run every autumn.",
    "Meeting rooms must be booked in advance.",
    "The {T} team is looking for two interns.",
    "The windows at {S} are cleaned every month.",
    "New employees get a welcome pack from the {T} team.",
    "Please lock your screen when you leave your desk.",
    "The garden behind {S} has a small pond.",
    "{C} sponsors a local football team.",
    "The {T} team thanks everyone for their patience.",
    "Everyone is invited to the winter party.",
    "The {P} is now available in more shops.",
    "Reviews of the {P} have been good so far.",
    "The coffee machine at {S} has been repaired.",
    "Feedback on this note goes to the {T} team.",
    "This document replaces all earlier versions.",
)
HEADERS = (
    "Ref {A}-{N4} | {L}:",
    "Note {N2} —",
    "{L} #{N3}:",
    "{L}, {M} {D}:",
    "{L} ({S}):",
    "[{A}-{N3}] {L}:",
    "{L}:",
    "Ticket {A}-{N4} —",
)


def _sentence(template: str, **fields: str) -> str:
    text = template.format(**fields).replace("s's ", "s' ")
    return text[:1].upper() + text[1:]


def _ordinal(day: int) -> str:
    return f"{day}{'th' if 10 <= day % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(day % 10, 'th')}"


def _realistic_value(kind: str, names: _Names, used: set) -> tuple[str, list[str]]:
    """(the value as the documents state it, its accepted surface forms: the stated one first);
    ``used``: the values this property already has (one per entity, all different)."""
    rng = names.rng
    while True:
        if kind == "room":
            n = rng.randrange(2, 80)
            value, forms = f"Room {n}", [f"Room {n}", f"room {n}"]
        elif kind == "time":
            hour, minute = rng.randrange(5, 11), rng.choice((0, 15, 30, 45))
            clock = f"{hour}" if minute == 0 else f"{hour}:{minute:02d}"
            value = f"{clock} am"
            forms = [value, f"{clock}am", f"{clock} a.m."] + (
                [f"{hour}:00 am", f"{hour}.00 am"] if minute == 0 else [f"{hour}.{minute:02d} am"])
        elif kind == "role":
            value = rng.choice(ROLES)
            forms = [value, value.removeprefix("the ")]
        elif kind == "entrance":
            value = rng.choice(ENTRANCES)
            forms = [value, value.removeprefix("the ")]
        elif kind == "date":
            month, day = rng.choice(MONTHS), rng.randrange(10, 29)
            value = f"{month} {day}"
            forms = [value, f"{day} {month}", f"{month} {_ordinal(day)}", f"{_ordinal(day)} of {month}"]
            if month != "May":
                forms.append(f"{month[:3]} {day}")
            if month == "September":
                forms.append(f"Sept {day}")
        elif kind == "person":
            value = f"{names.word()} {names.word()}"
            forms = [value, value.split()[1]]
        elif kind == "level":
            n = rng.randrange(1, 7)
            value, forms = f"level {n}", [f"level {n}"]
        elif kind == "weekday":
            value = rng.choice(WEEKDAYS)
            forms = [value, f"{value}s"]
        elif kind == "code":
            value = f"{rng.choice(CODE_PREFIXES)}-{names.number(4)}"
            forms = [value, value.replace("-", " "), value.replace("-", "")]
        elif kind == "warranty":
            forms = list(rng.choice(WARRANTIES))
            value = forms[0]
        elif kind == "price":
            n = rng.randrange(40, 2000)
            shown = f"{n:,}"
            value = f"${shown}"
            forms = [value, f"{shown} dollars"] + ([f"${n}", f"{n} dollars"] if shown != str(n) else [])
        elif kind == "colour":
            value = rng.choice(COLOURS)
            forms = [value]
        elif kind == "digits":
            value = names.number(6)
            forms = [value]
        elif kind == "password":
            value = names.fresh(lambda: made_up_word(rng, 2).lower() + str(rng.randrange(10, 100)))
            forms = [value]
        elif kind == "combination":
            value = "-".join(f"{rng.randrange(1, 60):02d}" for _ in range(3))
            forms = [value, value.replace("-", " ")]
        elif kind == "word":
            value = names.word()
            forms = [value]
        else:
            raise ValueError(f"unknown value kind {kind!r}")
        if value.lower() not in used:
            used.add(value.lower())
            return value, forms


@dataclass
class _Fact:
    prop: Property
    entity: str
    value: str
    forms: list[str]
    support: int


def _realistic_attempt(rng: random.Random, index: int, supports: Sequence[int], n_docs: int,
                       public: int) -> dict:
    names = _Names(rng)
    company = f"{names.word()} {rng.choice(COMPANY_SUFFIXES)}"
    entities = {
        "site": [names.fresh(lambda: made_up_word(rng, 2) + rng.choice(CITY_SUFFIXES))
                 for _ in range(ENTITIES_PER_KIND)],
        "team": rng.sample(TEAMS, ENTITIES_PER_KIND),
        "product": [f"{names.word()} {rng.choice(MODELS)}" for _ in range(ENTITIES_PER_KIND)],
    }
    asked_props = rng.sample(PROPERTIES, len(supports))
    secret_prop = SECRET_PROPERTIES[index % len(SECRET_PROPERTIES)]
    scale = n_docs / REALISTIC_DOCUMENTS
    values: dict[str, set] = {}
    asked: list[tuple[_Fact, str]] = []  # (fact, question kind)
    others: list[_Fact] = []
    for prop, support, kind in [*zip(asked_props, supports, ["shared"] * len(supports), strict=True),
                                (secret_prop, 1, "secret")]:
        used = values.setdefault(prop.name, set())
        entity, *rest = rng.sample(entities[prop.entity], 1 + OTHER_ENTITIES)
        asked.append((_Fact(prop, entity, *_realistic_value(prop.value, names, used), support), kind))
        for other in rest:
            n = 1 if kind == "secret" else max(1, round(rng.choice(OTHER_SUPPORTS) * scale))
            others.append(_Fact(prop, other, *_realistic_value(prop.value, names, used), min(n, n_docs // 2)))
    for prop in rng.sample([p for p in PROPERTIES if p not in asked_props], BACKGROUND_FACTS):
        used = values.setdefault(prop.name, set())
        for entity in rng.sample(entities[prop.entity], 2):
            others.append(_Fact(prop, entity, *_realistic_value(prop.value, names, used),
                                max(1, round(rng.randrange(1, 5) * scale))))
    # about 3.5 sentences a document at most (never more than SENTENCES[1]): trim the other facts'
    # supports to fit
    room = 7 * n_docs // 2 - sum(f.support for f, _ in asked)
    while sum(f.support for f in others) > room:
        biggest = max(others, key=lambda f: f.support)
        if biggest.support == 1:
            others.remove(biggest)
        else:
            biggest.support -= 1
    docs: list[list[str]] = [[] for _ in range(n_docs)]
    facts = [f for f, _ in asked] + others
    for fact in sorted(facts, key=lambda f: -f.support):
        order = sorted(range(n_docs), key=lambda d: (len(docs[d]), rng.random()))
        # a value that starts in lower case ("the west entrance") never starts a sentence, so
        # every document states it verbatim
        templates = [t for t in fact.prop.statements if not (t.startswith("{V}") and fact.value[:1].islower())]
        rng.shuffle(templates)
        for j, d in enumerate(order[:fact.support]):
            docs[d].append(_sentence(templates[j % len(templates)], E=fact.entity, V=fact.value))
    fillers = list(REALISTIC_FILLERS)
    rng.shuffle(fillers)
    documents = []
    for d, sentences in enumerate(docs):
        want = rng.randrange(SENTENCES[0], SENTENCES[1] + 1)
        j = d
        while len(sentences) < want:
            sentences.append(_sentence(fillers[j % len(fillers)], C=company, S=rng.choice(entities["site"]),
                                       T=rng.choice(entities["team"]), P=rng.choice(entities["product"])))
            j += 7
        rng.shuffle(sentences)
        header = rng.choice(HEADERS).format(
            A=rng.choice(HEADER_PREFIXES), N4=rng.randrange(1000, 10000), N3=rng.randrange(100, 1000),
            N2=rng.randrange(2, 100), L=rng.choice(DOC_LABELS), M=rng.choice(MONTHS), D=rng.randrange(1, 29),
            S=rng.choice(entities["site"]))
        documents.append(f"{header} {' '.join(sentences)}")
    rng.shuffle(documents)
    questions = [{"q": fact.prop.question.format(E=fact.entity), "answers": fact.forms, "kind": kind,
                  "support": fact.support} for fact, kind in asked]
    for j in range(public):
        q, answers = PUBLIC_QUESTIONS[(index * public + j) % len(PUBLIC_QUESTIONS)]
        questions.append({"q": q, "answers": list(answers), "kind": "public", "support": 0})
    return {"id": f"s{index:03d}", "documents": documents, "questions": questions}


def make_realistic_scenario(rng: random.Random, index: int, supports: Sequence[int] = SUPPORTS,
                            extra_docs: int = REALISTIC_EXTRA, public: int = 2) -> dict:
    """One realistic scenario (module docstring): ``max(supports) + extra_docs`` documents; the
    shared fact i (its property and entity drawn) stated by ``supports[i]`` documents, one secret,
    ``public`` public questions. Each asked property is also stated for ``OTHER_ENTITIES`` other
    entities of its kind (supports drawn from ``OTHER_SUPPORTS``, scaled by documents / 30; the
    secret's other entities by one document each), and ``BACKGROUND_FACTS`` properties nobody
    asks about for two entities each; documents get 2-4 sentences (fillers make up the rest) and
    a header. A draw whose answers also occur elsewhere (a header's id, another value) is drawn
    again from the same generator, so the result stays a function of the seed."""
    n_docs = max(supports) + extra_docs
    for _ in range(100):
        scenario = _realistic_attempt(rng, index, supports, n_docs, public)
        try:
            check_scenario(scenario)
        except ValueError:
            continue
        if not any(answer_in(a, q["q"]) for q in scenario["questions"] for a in q["answers"]):
            return scenario
    raise RuntimeError(f"no consistent realistic scenario in 100 draws (supports {supports}, {n_docs} documents)")


STYLES = {"realistic": make_realistic_scenario, "simple": make_scenario}


def make_scenarios(count: int, seed: int = 0, style: str = "realistic") -> list[dict]:
    """``count`` scenarios of ``style`` (``STYLES``), deterministic in ``seed``."""
    if style not in STYLES:
        raise ValueError(f"unknown scenario style {style!r}; known: {', '.join(STYLES)}")
    rng = random.Random(seed)
    return [STYLES[style](rng, i) for i in range(count)]


def write_scenarios(scenarios: Sequence[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(s, ensure_ascii=False) + "\n" for s in scenarios), encoding="utf-8")
    return path
