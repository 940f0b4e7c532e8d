"""The private-context scenario generator (``vllm-dp bench context --make-scenarios``; ``bench
attention-ladder``'s large collections): a fictional company per scenario, shared facts stated by
``support`` documents, one secret fact (one document), public questions."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_dp_plugin.benchmarks.lib.scenarios import check_scenario

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


def make_scenarios(count: int, seed: int = 0) -> list[dict]:
    """``count`` scenarios, deterministic in ``seed``."""
    rng = random.Random(seed)
    return [make_scenario(rng, i) for i in range(count)]


def write_scenarios(scenarios: Sequence[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(s, ensure_ascii=False) + "\n" for s in scenarios), encoding="utf-8")
    return path
