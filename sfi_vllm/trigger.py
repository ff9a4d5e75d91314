"""SlowStepTrigger: which decode steps run dense attention and refresh the selection.

A decode step of a sequence is
* ``DENSE`` while its context is shorter than ``dense_below_context`` (no SFI at all);
* ``SLOW`` when any trigger fires:
  - ``FIRST_DECODE``: the first step after a prefill (or after leaving the dense range),
  - ``REUSE_BUDGET``: ``reuse_budget`` fast steps have run since the last slow step,
  - ``BOUNDARY``: a sentence just ended, and at least ``min_gap`` fast steps have run since the
    last slow step. With ``boundary_fire="next_token"`` (the authors' choice) it fires on the first
    non-whitespace token after the ender; with ``"at_ender"`` on the step whose input is the ender;
    a boundary that arrives inside the gap is dropped;
* ``FAST`` otherwise.

The state is a few tensors indexed by request slot, and :meth:`SlowStepTrigger.step` is vectorised
over the batch's decode rows, so the same code runs on the GPU without a host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from sfi_vllm.config import SFIConfig

ENDER_CHARS = frozenset(".?!。？！…")
CLOSER_CHARS = frozenset("\"'”’)]」』»")


class StepMode(IntEnum):
    PREFILL = 0
    DENSE = 1
    SLOW = 2
    FAST = 3


class SlowReason(IntEnum):
    NONE = 0
    FIRST_DECODE = 1
    REUSE_BUDGET = 2
    BOUNDARY = 3


@dataclass(frozen=True)
class BoundaryTokens:
    """Token ids that end a sentence, and whitespace-only ids skipped before firing."""

    enders: frozenset[int]
    skips: frozenset[int]


def classify_token_text(text: str, newline_is_boundary: bool) -> tuple[bool, bool]:
    """``(is_ender, is_skip)`` for one token's decoded text."""
    stripped = text.strip()
    if not stripped:
        is_skip = bool(text)
        return (newline_is_boundary and "\n" in text), is_skip
    is_ender = all(c in ENDER_CHARS or c in CLOSER_CHARS for c in stripped) and any(
        c in ENDER_CHARS for c in stripped
    )
    if newline_is_boundary and "\n" in text and not is_ender:
        # a merged form such as ".\n" is covered above; "word\n" ends a line, count it too
        is_ender = text.rstrip(" \t").endswith("\n")
    return is_ender, False


def boundary_tokens_from_tokenizer(tokenizer, newline_is_boundary: bool = True) -> BoundaryTokens:
    """Derive the sentence-ender set from any Hugging Face tokenizer's vocabulary."""
    vocab_size = len(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = [i for i in range(vocab_size) if i not in special]
    texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    enders, skips = set(), set()
    for i, text in zip(ids, texts):
        is_ender, is_skip = classify_token_text(text, newline_is_boundary)
        if is_ender:
            enders.add(i)
        if is_skip:
            skips.add(i)
    if not enders:
        raise ValueError("sfi-vllm: found no sentence-ending token in the tokenizer's vocabulary")
    return BoundaryTokens(frozenset(enders), frozenset(skips))


class SlowStepTrigger:
    def __init__(
        self,
        cfg: SFIConfig,
        num_slots: int,
        vocab_size: int,
        boundary: BoundaryTokens | None,
        device: torch.device | str = "cpu",
    ) -> None:
        if cfg.boundary_trigger and boundary is None:
            raise ValueError(
                "sfi-vllm: the boundary trigger needs sentence-ender token ids: serve with a "
                "tokenizer, set sfi.boundary_token_ids, or set sfi.boundary_trigger=false"
            )
        self.cfg = cfg
        self.device = torch.device(device)
        self.ender = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
        self.skip = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
        if boundary is not None:
            for mask, ids in ((self.ender, boundary.enders), (self.skip, boundary.skips)):
                valid = [i for i in ids if 0 <= i < vocab_size]
                if valid:
                    mask[torch.tensor(valid, device=self.device)] = True
        self.fast_since_slow = torch.zeros(num_slots, dtype=torch.int32, device=self.device)
        self.pending = torch.zeros(num_slots, dtype=torch.bool, device=self.device)
        self.initialized = torch.zeros(num_slots, dtype=torch.bool, device=self.device)

    def reset(self, slots: torch.Tensor) -> None:
        """A request started, was preempted or finished: its next decode step is a first step."""
        slots = slots.to(self.device, torch.long)
        self.fast_since_slow[slots] = 0
        self.pending[slots] = False
        self.initialized[slots] = False

    def step(
        self, slots: torch.Tensor, tokens: torch.Tensor, context_lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decide and advance one decode step for each row.

        ``slots``: request slots; ``tokens``: each row's input token (the last sampled one);
        ``context_lens``: tokens in the KV cache including this step's. Returns ``(mode, reason)``
        as int8 tensors of :class:`StepMode` and :class:`SlowReason` values.
        """
        cfg = self.cfg
        slots = slots.to(self.device, torch.long)
        tokens = tokens.to(self.device, torch.long).clamp(0, self.ender.numel() - 1)
        context_lens = context_lens.to(self.device)

        fast_since = self.fast_since_slow[slots]
        pending = self.pending[slots]
        is_ender = self.ender[tokens]
        is_skip = self.skip[tokens]
        if cfg.boundary_fire == "next_token":
            boundary = pending & ~is_skip
            new_pending = is_ender | (pending & is_skip)
        else:
            boundary = is_ender
            new_pending = torch.zeros_like(pending)
        if not cfg.boundary_trigger:
            boundary = torch.zeros_like(boundary)

        dense = context_lens < cfg.dense_below_context
        first = ~self.initialized[slots]
        reuse = fast_since >= cfg.reuse_budget
        bound = boundary & (fast_since >= cfg.min_gap)
        slow = ~dense & (first | reuse | bound)

        reason = torch.full_like(slots, int(SlowReason.NONE))
        reason = torch.where(slow & bound, int(SlowReason.BOUNDARY), reason)
        reason = torch.where(slow & reuse, int(SlowReason.REUSE_BUDGET), reason)
        reason = torch.where(slow & first, int(SlowReason.FIRST_DECODE), reason)
        mode = torch.full_like(slots, int(StepMode.FAST))
        mode = torch.where(slow, int(StepMode.SLOW), mode)
        mode = torch.where(dense, int(StepMode.DENSE), mode)

        self.fast_since_slow[slots] = torch.where(
            slow | dense, torch.zeros_like(fast_since), fast_since + 1
        )
        self.initialized[slots] = ~dense
        self.pending[slots] = new_pending & ~dense
        return mode.to(torch.int8), reason.to(torch.int8)
