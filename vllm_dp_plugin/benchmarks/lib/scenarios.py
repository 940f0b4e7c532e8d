"""The private-context benchmarks' shared data: the chat model, the scenarios (``bench context``'s
schema and bundled file), the token layout of a context and a question, answer scoring, and the
model's cached public calibration. Used by ``bench context`` and ``benchmarks.attention_real``;
``resolve_model`` also by ``benchmarks.train``, ``bench canary`` and ``benchmarks.aggregate_batch``."""

from __future__ import annotations

import json
import os
import re
import unicodedata
from collections.abc import Sequence
from pathlib import Path

DEFAULT_MODEL = ".models/smollm2-135m-instruct"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"  # built with vllm_dp_plugin.models.import_model when missing
DEFAULT_SCENARIOS = Path(__file__).resolve().parent.parent / "data" / "context-scenarios.jsonl"  # realistic, seed 0
# the set bundled before issue 48 (style "simple", seed 0): earlier results were measured on it
SIMPLE_SCENARIOS = DEFAULT_SCENARIOS.with_name("context-scenarios-simple.jsonl")
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-dp" / "bench-context"
ANSWER_TOKENS = 32
KINDS = ("shared", "secret", "public")


def phrase_in(phrase: str, text: str) -> bool:
    """``phrase`` occurs in ``text`` (case-insensitive) as a whole phrase, not inside a longer word
    or number: "Room 12" is not in "Room 120", "2 years" not in "12 years", "Orsk" is in "Orsk's"."""
    return re.search(rf"(?<![^\W_]){re.escape(phrase.lower())}(?![^\W_])", text.lower()) is not None


_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_ORDINAL = re.compile(r"(?<=\d)(?:st|nd|rd|th)\b", re.IGNORECASE)
_MERIDIEM = re.compile(r"\b([ap])\.\s?m\.?", re.IGNORECASE)
TOKEN = re.compile(r"\d+|[^\W\d_]+")  # digits and letters apart: "8am" -> "8", "am"


def normal_text(text: str) -> str:
    """NFKC, "a.m."/"p.m." as "am"/"pm", thousands separators and ordinal suffixes dropped."""
    text = _MERIDIEM.sub(lambda m: f"{m.group(1)}m", unicodedata.normalize("NFKC", text))
    return _ORDINAL.sub("", _THOUSANDS.sub("", text))


def norm_words(text: str) -> list[str]:
    """``text``'s words as answers are compared: ``normal_text``, case-folded, runs of digits and
    runs of letters apart, everything else a separator: "8:30 a.m." -> ["8", "30", "am"], "2,718"
    -> ["2718"], "September 14th" -> ["september", "14"]."""
    return [w.casefold() for w in TOKEN.findall(normal_text(text))]


def contains_run(seq: Sequence[str], part: Sequence[str]) -> bool:
    """``part`` occurs in ``seq`` in order and without gaps (an empty ``part`` never does)."""
    return bool(part) and any(list(seq[i:i + len(part)]) == list(part) for i in range(len(seq) - len(part) + 1))


def answer_in(answer: str, text: str) -> bool:
    """``answer`` is stated in ``text``: as a phrase (``phrase_in``) or as the same run of words
    once punctuation, case, ordinal suffixes and thousands separators are set aside (``norm_words``:
    "8 30 am" states "8:30 am", "September 14th" states "September 14", "8 a.m." states "8 am")."""
    return phrase_in(answer, text) or contains_run(norm_words(text), norm_words(answer))


def check_scenario(s: dict) -> None:
    """Raise ``ValueError`` unless ``s`` has the scenario schema and its facts are where they
    claim: a shared fact's first answer in exactly ``support`` documents (and no answer of it in
    any other), a secret in exactly one (the first answer verbatim, ``phrase_in``; no document
    that does not state it may state any answer as ``is_correct`` reads them, ``answer_in``)."""
    where = f"scenario {s.get('id')!r}"
    if not isinstance(s.get("id"), str) or not s["id"] or not isinstance(s.get("documents"), list):
        raise ValueError(f"{where}: needs a non-empty string 'id' and a list 'documents'")
    docs = s["documents"]
    for q in s.get("questions") or []:
        if set(q) != {"q", "answers", "kind", "support"} or q["kind"] not in KINDS or not q["answers"]:
            raise ValueError(f"{where}: bad question {q!r}")
        if q["kind"] == "public":
            continue
        if q["kind"] == "secret" and q["support"] != 1:
            raise ValueError(f"{where}: a secret has support 1, got {q['support']}")
        stating = sum(phrase_in(q["answers"][0], d) for d in docs)
        mention = sum(any(answer_in(a, d) for a in q["answers"]) for d in docs)
        if stating != q["support"] or mention != q["support"]:
            raise ValueError(f"{where}: {q['q']!r} is stated by {stating} documents (mentioned by "
                             f"{mention}), support says {q['support']}")
    if not s.get("questions"):
        raise ValueError(f"{where}: no questions")


def load_scenarios(path: str | Path) -> list[dict]:
    scenarios = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    ids = [s.get("id") for s in scenarios]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate scenario ids")
    for s in scenarios:
        check_scenario(s)
    return scenarios


def is_correct(text: str, answers: Sequence[str], tokenizer=None, max_tokens: int = ANSWER_TOKENS) -> bool:
    """Any of ``answers`` is stated in ``text`` (``answer_in``: as a whole phrase, case-insensitive,
    or as the same words apart from punctuation: "8 30 am" for "8:30 am"),
    cut to its first ``max_tokens`` tokens when a ``tokenizer`` is given (the benchmark asks for
    ``max_tokens`` tokens, so its completions need no cut)."""
    if tokenizer is not None:
        text = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:max_tokens])
    return any(answer_in(a, text) for a in answers)


class ChatLayout:
    """The token sequences of every row, from the model's own chat template.

    ``C`` (the context) = the template rendered with the system turn alone, holding the documents
    one per line; the user turn = the rendering of [system, user] with the generation prompt,
    minus ``C``. The context's ids are what the DP renderer makes of the context file
    (``tokenize_context``: the BOS the tokenizer adds, if any, + text); if it adds one and ``C``
    starts with the BOS token's text, ``C`` is written without it, so that BOS is not doubled."""

    def __init__(self, tokenizer) -> None:
        from vllm_dp_plugin.serving.context import added_bos, tokenize_context

        self.tokenizer, self._tokenize_context = tokenizer, tokenize_context
        self.bos = added_bos(tokenizer)  # the renderer's rule: only an added BOS is dropped

    def _render(self, messages, generation: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)

    def context_text(self, documents: Sequence[str]) -> str:
        """The private context file's text."""
        text = self._render([{"role": "system", "content": "\n".join(documents)}], False)
        bos = self.tokenizer.bos_token
        if self.bos is not None and bos and text.startswith(bos):
            text = text[len(bos):]
        return text

    def context_ids(self, documents: Sequence[str]) -> list[int]:
        return list(self._tokenize_context(self.context_text(documents), self.tokenizer))

    def user_ids(self, documents: Sequence[str], question: str) -> list[int]:
        system = [{"role": "system", "content": "\n".join(documents)}]
        alone = self._render(system, False)
        both = self._render([*system, {"role": "user", "content": question}], True)
        if not both.startswith(alone):
            raise ValueError("the chat template renders the system turn differently when a user turn follows")
        return self.tokenizer.encode(both[len(alone):], add_special_tokens=False)

    # the prompt each row sends (token ids) and the prompt length the server must report
    def full_ids(self, documents, question) -> list[int]:
        return self.context_ids(documents) + self.user_ids(documents, question)

    def none_ids(self, documents, question) -> list[int]:
        ids = self.user_ids(documents, question)
        return ids if self.bos is None or (ids and ids[0] == self.bos) else [self.bos, *ids]

    def dp_ids(self, documents, question) -> list[int]:
        """The request's ids for a DP row: the renderer drops one leading BOS of a request (the
        context already starts with it), so a user turn that starts with BOS gets a second one."""
        ids = self.user_ids(documents, question)
        return [self.bos, *ids] if self.bos is not None and ids and ids[0] == self.bos else ids


def ensure_model(model: str) -> str:
    if (Path(model) / "config.json").exists():
        return model
    if Path(model) == Path(DEFAULT_MODEL):
        from vllm_dp_plugin.models import import_model

        return str(import_model(DEFAULT_MODEL_NAME, model))
    raise SystemExit(f"vllm-dp bench: no model at {model}")


MODEL_ALIASES = {"smollm2": DEFAULT_MODEL}  # --model NAME -> directory (SmolLM2 is imported when missing)


def resolve_model(text: str) -> tuple[str, str]:
    """``(name, directory)`` of a suite's ``--model``: an alias (``smollm2``; imported when
    missing) or a directory with a ``config.json`` (named by its last component, for the result
    files)."""
    if text in MODEL_ALIASES:
        return text, ensure_model(MODEL_ALIASES[text])
    if not (Path(text) / "config.json").exists():
        raise ValueError(f"--model {text!r}: not one of {sorted(MODEL_ALIASES)} nor a directory with a config.json")
    name = re.sub(r"[^a-z0-9._-]+", "-", Path(text).resolve().name.lower()).strip("-.") or "model"
    return name, text


def cached_calibration(model: str, cache_dir: Path) -> Path:
    """``model``'s public calibration (``vllm-dp calibrate``), cached in ``cache_dir`` by weights digest."""
    from vllm_dp_plugin.calibration import calibrate_model
    from vllm_dp_plugin.serving.context import weights_digest

    path = cache_dir / f"calibration-{Path(model).name}-{weights_digest(model)[:16]}.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        calibrate_model(model, tmp)
        tmp.replace(path)
    return path
