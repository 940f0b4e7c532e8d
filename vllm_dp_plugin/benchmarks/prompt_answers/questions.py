"""The questions of ``vllm-dp bench prompt-answers``: each scenario question as a chat (its documents,
the question) and the segments the privatizer sees (``Question``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm_dp_plugin.prompt.segments import Segment, mark_user_texts, segment_chat

MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class Question:
    """One question as the model sees it: ``segments`` (``segment_chat``: template pieces and the
    one private segment, the user's text, at ``private``)."""

    scenario: str
    index: int  # position within the scenario
    kind: str
    text: str
    answers: tuple[str, ...]
    segments: tuple[Segment, ...]
    private: int  # index of the user text's segment

    @property
    def key(self) -> str:
        return f"{self.scenario}/{self.index}"

    @property
    def user_ids(self) -> tuple[int, ...]:
        return self.segments[self.private].ids

    def prompt_ids(self, user_ids: Sequence[int] | None = None) -> list[int]:
        """The prompt's ids with the user text's ids replaced by ``user_ids`` (any length)."""
        out: list[int] = []
        for i, segment in enumerate(self.segments):
            out.extend(user_ids if i == self.private and user_ids is not None else segment.ids)
        return out

    def private_mask(self) -> list[bool]:
        return [s.private for s in self.segments for _ in s.ids]


def chat_messages(kind: str, documents: Sequence[str], question: str) -> list[dict]:
    """No system prompt for public questions; the documents as a plain system prompt (one per line)
    otherwise."""
    user = {"role": "user", "content": question}
    if kind == "public":
        return [user]
    return [{"role": "system", "content": "\n".join(documents)}, user]


def question_segments(tokenizer, messages: Sequence[dict], max_tokens: int | None = MAX_MODEL_LEN) -> list[Segment]:
    """The server renderer's segmentation of a chat (``serving.renderer._privatize_chat``): the
    template rendered with the user text and with a sentinel in its place, every piece tokenised
    on its own without added special tokens."""
    marked = mark_user_texts(messages)

    def render(msgs) -> str:
        return tokenizer.apply_chat_template(list(msgs), tokenize=False, add_generation_prompt=True)

    return segment_chat(marked, render(messages), render(marked.messages),
                        lambda text: tokenizer.encode(text, add_special_tokens=False), max_tokens=max_tokens)


def build_questions(tokenizer, scenarios: Sequence[dict]) -> list[Question]:
    out = []
    for s in scenarios:
        for i, q in enumerate(s["questions"]):
            segments = question_segments(tokenizer, chat_messages(q["kind"], s["documents"], q["q"]))
            private = [j for j, seg in enumerate(segments) if seg.private]
            if len(private) != 1:
                raise ValueError(f"{s['id']}/{i}: expected one private segment, got {len(private)}")
            out.append(Question(s["id"], i, q["kind"], q["q"], tuple(q["answers"]), tuple(segments), private[0]))
    return out
