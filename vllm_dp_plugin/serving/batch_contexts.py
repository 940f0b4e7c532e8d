"""Which private context each request of a step reads, derived on the worker from its own prompt ids.

A deployment may serve several named private contexts (``attention.contexts``); the renderer
prepends the one a request picks. The attention layers must answer each request's public queries
from that context's release and from nothing else. The worker does not trust a second channel that
could disagree with the renderer: it reads the context off the request's prompt token ids, request
``r`` reads context ``c`` iff ``prompt_token_ids[:P_c] == ids_c`` (and a public token follows).
Start-up refuses contexts whose ids are a prefix of another's, so at most one matches; a request
matching none (impossible through the renderer) stops the step with a RuntimeError: its positions
are never treated as public.

vLLM's V1 model runner (``GPUModelRunner``; ``CPUModelRunner`` subclasses it) is wrapped by the
general plugin (``install``): around ``_build_attention_metadata`` it announces the step's
``BatchContexts`` (batch order; each request matched once and cached) to the DP metadata builder,
which reads them with ``announced``. Any other runner (Model Runner V2) announces nothing, and the
builder refuses the step: fail closed.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from .context import PrivateContext

HOOK_MARK = "_vllm_dp_announces_contexts"  # set on the wrapped runner method
TRACKER = "_vllm_dp_request_contexts"  # a runner's RequestContexts (or None), in its __dict__


@dataclass(frozen=True)
class BatchContexts:
    """``index: [B]``: the context each request of the step reads (its position in
    ``settings.private_contexts``); ``length: [B]``: that context's token count P; ``head: [B]``
    and ``end: [B]``: its private span ``[head, end)`` (``end = P`` under unit row; positions >=
    ``end`` are the request's public queries)."""

    index: torch.Tensor
    length: torch.Tensor
    head: torch.Tensor
    end: torch.Tensor


def match_context(contexts: Sequence[PrivateContext], prompt_ids: Sequence[int] | None) -> int:
    """The index of the one context whose ids start ``prompt_ids`` with at least one id after
    them. RuntimeError when none or several do: the request's positions cannot be attributed."""
    ids = tuple(prompt_ids or ())
    found = [i for i, c in enumerate(contexts) if len(ids) > c.length and ids[: c.length] == c.token_ids]
    if len(found) != 1:
        raise RuntimeError(
            f"vllm-dp: a scheduled request starts with {len(found)} of the served private contexts, "
            "not exactly one (only the dp_private renderer may build prompts): refusing the step"
        )
    return found[0]


class RequestContexts:
    """One model runner's requests -> context index, matched once per request state (a request
    re-added by vLLM comes with a new state object and is matched again)."""

    def __init__(self, contexts: Sequence[PrivateContext]):
        self.contexts = tuple(contexts)
        self._lengths = torch.tensor([c.length for c in self.contexts], dtype=torch.long)
        self._heads = torch.tensor([c.head for c in self.contexts], dtype=torch.long)
        self._ends = torch.tensor([c.private_end for c in self.contexts], dtype=torch.long)
        self._known: dict[str, tuple[object, int]] = {}

    def of_batch(self, req_ids: Sequence[str], requests: Mapping[str, object]) -> BatchContexts:
        """The ``BatchContexts`` of the requests ``req_ids`` (batch order), whose runner states
        (``prompt_token_ids``) are ``requests[req_id]``; forgets requests no longer scheduled."""
        known = {}
        for req_id in req_ids:
            state = requests.get(req_id)
            if state is None:
                raise RuntimeError("vllm-dp: a scheduled request has no state in the model runner: refusing the step")
            cached = self._known.get(req_id)
            hit = cached is not None and cached[0] is state
            known[req_id] = cached if hit else (state, match_context(self.contexts, state.prompt_token_ids))
        self._known = known
        index = torch.tensor([known[r][1] for r in req_ids], dtype=torch.long)
        return BatchContexts(index, self._lengths[index], self._heads[index], self._ends[index])


_announced: BatchContexts | None = None


@contextlib.contextmanager
def announcing(contexts: BatchContexts) -> Iterator[BatchContexts]:
    """Make ``contexts`` the current step's for the block (the metadata builders run inside)."""
    global _announced
    previous, _announced = _announced, contexts
    try:
        yield contexts
    finally:
        _announced = previous


def announced(num_requests: int) -> BatchContexts:
    """The current step's ``BatchContexts`` for a batch of ``num_requests`` requests.
    RuntimeError when the model runner announced none, or for another batch size."""
    if _announced is None:
        raise RuntimeError(
            "vllm-dp: the model runner did not say which private context each request reads (only "
            "vLLM's V1 model runner is wrapped; set VLLM_USE_V2_MODEL_RUNNER=0): refusing the step"
        )
    if _announced.index.shape[0] != num_requests:
        raise RuntimeError(
            f"vllm-dp: the model runner announced the contexts of {_announced.index.shape[0]} requests "
            f"for a batch of {num_requests}: refusing the step"
        )
    return _announced


def _request_contexts(runner) -> RequestContexts | None:
    """The runner's ``RequestContexts`` when it serves private contexts, else None (cached)."""
    if TRACKER not in runner.__dict__:
        from .settings import private_contexts, serves_private_contexts

        config = runner.vllm_config
        runner.__dict__[TRACKER] = RequestContexts(private_contexts(config)) if serves_private_contexts(config) else None
    return runner.__dict__[TRACKER]


def _announce_contexts(build):
    """``GPUModelRunner._build_attention_metadata`` announcing the step's contexts around it."""

    @functools.wraps(build)
    def wrapper(runner, *args, **kwargs):
        tracker = _request_contexts(runner)
        if tracker is None:
            return build(runner, *args, **kwargs)
        with announcing(tracker.of_batch(runner.input_batch.req_ids, runner.requests)):
            return build(runner, *args, **kwargs)

    setattr(wrapper, HOOK_MARK, True)
    return wrapper


def runner_announces(runner) -> bool:
    """Whether ``runner`` (a worker's model runner) announces its requests' contexts."""
    return bool(getattr(getattr(type(runner), "_build_attention_metadata", None), HOOK_MARK, False))


def install() -> None:
    """Wrap the V1 model runner (idempotent; a pass-through without private contexts)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not getattr(GPUModelRunner._build_attention_metadata, HOOK_MARK, False):
        GPUModelRunner._build_attention_metadata = _announce_contexts(GPUModelRunner._build_attention_metadata)
