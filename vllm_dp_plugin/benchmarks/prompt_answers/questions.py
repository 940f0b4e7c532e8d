"""The questions of ``vllm-dp bench prompt-answers``: each scenario question as a chat (its documents,
the question) and the segments the privatizer sees (``Question``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from vllm_dp_plugin.prompt.segments import Segment, mark_user_texts, segment_chat, splice

MAX_MODEL_LEN = 2048
KINDS = ("public", "shared", "secret")  # question kinds, in report order


@dataclass(frozen=True)
class Question:
    """One question as the model sees it: ``segments`` (``segment_chat``: template pieces and the
    one private segment, the user's text, at ``private``)."""

    key: str  # scenario id/position in the scenario
    kind: str
    text: str
    answers: tuple[str, ...]
    segments: tuple[Segment, ...]
    private: int  # index of the user text's segment

    @property
    def user_ids(self) -> tuple[int, ...]:
        return self.segments[self.private].ids

    def prompt_ids(self, user_ids: Sequence[int] | None = None) -> list[int]:
        """The prompt's ids with the user text's ids replaced by ``user_ids`` (any length)."""
        segments = list(self.segments)
        if user_ids is not None:
            segments[self.private] = Segment(tuple(user_ids), True)
        return splice(segments)[0]


def chat_messages(kind: str, documents: Sequence[str], question: str) -> list[dict]:
    """No system prompt for a public question; else the documents as a plain system prompt, one a line."""
    user = {"role": "user", "content": question}
    return [user] if kind == "public" else [{"role": "system", "content": "\n".join(documents)}, user]


def build_questions(tokenizer, scenarios: Sequence[dict]) -> list[Question]:
    """Every question of ``scenarios``, segmented as the server's renderer does (``_privatize_chat``):
    the template rendered with the user text and with a sentinel in its place, every piece
    tokenised on its own without added special tokens."""
    render = partial(tokenizer.apply_chat_template, tokenize=False, add_generation_prompt=True)
    encode = partial(tokenizer.encode, add_special_tokens=False)
    out = []
    for s in scenarios:
        for i, q in enumerate(s["questions"]):
            chat = chat_messages(q["kind"], s["documents"], q["q"])
            marked = mark_user_texts(chat)
            segments = segment_chat(marked, render(chat), render(marked.messages), encode, max_tokens=MAX_MODEL_LEN)
            private = next(j for j, seg in enumerate(segments) if seg.private)  # the one user text
            out.append(Question(f"{s['id']}/{i}", q["kind"], q["q"], tuple(q["answers"]), tuple(segments), private))
    return out
