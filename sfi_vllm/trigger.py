"""SlowStepTrigger: which decode steps refresh the selection (slow steps) or attend densely.

A decode step of a sequence is
* ``DENSE`` while its context is shorter than ``dense_below_context``, and for the first
  ``bridge_steps`` decode steps after a prefill (``sfi`` policy only, ``bridge_attention`` dense):
  no SFI at all;
* ``SLOW`` when any trigger fires:
  - ``FIRST_DECODE``: the first step after a prefill (or after leaving the dense range); with
    ``bridge_attention`` selected it chooses a provisional set for the bridge's steps,
  - ``BRIDGE_END``: ``bridge_attention`` selected, the first step past the bridge: the first
    selection proper (it attends densely, as a ``FIRST_DECODE`` step does),
  - ``REUSE_BUDGET``: ``reuse_budget`` fast steps have run since the last slow step (with
    ``reuse_stagger``, the first interval after a request's first selection is shorter by an offset
    derived from its context length and its prompt's tokens, :func:`reuse_offset`, so that requests
    that start together refresh on different steps, equal lengths included),
  - ``BOUNDARY``: a sentence just ended, and at least ``min_gap`` fast steps have run since the
    last slow step. With ``boundary_fire="next_token"`` (the authors' choice) it fires on the first
    non-whitespace token after the ender; with ``"at_ender"`` on the step whose input is the ender;
    a boundary that arrives inside the gap is dropped;
* ``FAST`` otherwise.

The state is a few host (numpy) arrays indexed by request slot, and :meth:`SlowStepTrigger.step`
is vectorised over the batch's decode rows. The controller feeds it through a reader of the last
sampled tokens (:func:`token_reader`, ``sfi.boundary_read``): :class:`DeferredTokens` reads them
only at steps whose decisions depend on them (exact), :class:`LaggedTokens` copies them
asynchronously and uses each one step later (lagged; the default on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any
import zlib

import numpy as np
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
    VERIFY = 4  # sfi.mode lossless: a drafter's first pass after the model verified its drafts
    BRIDGE_END = 5  # bridge_attention selected: the first selection proper, at the bridge's end


# slow steps that make a request's first selection (proper): they attend densely and refresh
# every layer, and the reuse stagger's offset is drawn at them
FIRST_SELECTION = (SlowReason.FIRST_DECODE, SlowReason.BRIDGE_END)


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


GOLDEN_FRACTION = 0.6180339887498949


def _host(x: Any, dtype: Any) -> np.ndarray:
    """A host array of ``x`` (a torch tensor on any device, a numpy array or a sequence)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype)


def prompt_phase(prompt_token_ids: Any) -> int:
    """A request's reuse phase key (for :func:`reuse_offset`): the CRC-32 of its prompt's token
    ids as int32 (0 without them; an int32 numpy array, as vLLM's input batch holds them, is
    hashed without a copy). It depends on the prompt alone, so a request's steps do not depend on
    which others share its batch, and different prompts of one length get independent phases."""
    if prompt_token_ids is None or len(prompt_token_ids) == 0:
        return 0
    return zlib.crc32(np.ascontiguousarray(prompt_token_ids, dtype=np.int32))


def reuse_offset(context_lens: Any, reuse_budget: Any, phases: Any = None) -> np.ndarray:
    """The per-request phase of the reuse budget: ``floor(frac((context + phase) x 0.618...) x
    budget)``, in ``[0, budget)``, from the context length at the request's first selection and
    its prompt's phase key (:func:`prompt_phase`; None: 0). Both depend on the request alone. For
    one prompt, consecutive contexts land far apart (the golden-ratio sequence is evenly spread);
    different prompts' keys make their phases independent, so 16 requests take about 14 distinct
    phases of 64 and 11 of 20, and identical prompts share one."""
    ctx = _host(context_lens, np.float64)
    if phases is not None:
        ctx = ctx + _host(phases, np.float64)
    budget = _host(reuse_budget, np.int64)
    frac = np.modf(ctx * GOLDEN_FRACTION)[0]
    return np.clip(np.minimum((frac * budget).astype(np.int64), budget - 1), 0, None).astype(np.int32)


class SlowStepTrigger:
    """Per-slot trigger state and per-slot settings (requests may carry their own SFI config).

    The state lives in host (numpy) arrays indexed by slot; each call takes the batch's rows at
    once. Inputs may be torch tensors (any device), numpy arrays or sequences; :meth:`step`
    returns torch int8 tensors. numpy rather than torch: a step is a few dozen elementwise
    operations on arrays of batch size, where torch's per-operation cost on the host (about
    10 us) made the trigger most of a step's planning."""

    def __init__(
        self,
        cfg: SFIConfig,
        num_slots: int,
        vocab_size: int,
        boundary: BoundaryTokens | None,
    ) -> None:
        self.has_boundary = boundary is not None
        self.vocab_size = vocab_size
        self.ender = np.zeros(vocab_size, dtype=bool)
        self.skip = np.zeros(vocab_size, dtype=bool)
        if boundary is not None:
            for mask, ids in ((self.ender, boundary.enders), (self.skip, boundary.skips)):
                valid = [i for i in ids if 0 <= i < vocab_size]
                if valid:
                    mask[np.asarray(valid)] = True
        self.fast_since_slow = np.zeros(num_slots, dtype=np.int32)
        self.pending = np.zeros(num_slots, dtype=bool)
        self.initialized = np.zeros(num_slots, dtype=bool)
        # per-slot settings
        self.reuse_budget = np.zeros(num_slots, dtype=np.int32)
        self.min_gap = np.zeros(num_slots, dtype=np.int32)
        self.boundary_on = np.zeros(num_slots, dtype=bool)
        self.at_ender = np.zeros(num_slots, dtype=bool)
        self.dense_below = np.zeros(num_slots, dtype=np.int64)
        self.never_slow = np.zeros(num_slots, dtype=bool)
        self.bridge = np.zeros(num_slots, dtype=np.int32)
        self.bridge_selected = np.zeros(num_slots, dtype=bool)  # bridge_attention selected
        # bridge_attention selected: the row's bridge has not yet ended with its BRIDGE_END step
        self.bridge_open = np.zeros(num_slots, dtype=bool)
        self.stagger = np.zeros(num_slots, dtype=bool)
        # reuse-budget offset of the current interval (reuse_stagger: set at a first selection),
        # and each slot's request's phase key (prompt_phase)
        self.offset = np.zeros(num_slots, dtype=np.int32)
        self.phase = np.zeros(num_slots, dtype=np.int64)
        # the bridge: decode steps whose context is below bridge_until[slot] are dense; it is set at
        # the slot's first decode step after a reset (fresh), from that step's context
        self.fresh = np.ones(num_slots, dtype=bool)
        self.bridge_until = np.zeros(num_slots, dtype=np.int64)
        self.default_cfg = cfg
        for slot in range(num_slots):
            self.configure(slot, cfg)

    def configure(self, slot: int, cfg: SFIConfig, phase: int = 0) -> None:
        """Apply ``cfg``'s trigger settings and policy to one slot, for a request whose prompt has
        the phase key ``phase`` (:func:`prompt_phase`)."""
        # lossless mode runs no trigger (its drafter re-selects at verify steps): a request there
        # may ask for the boundary trigger on an engine without enders (request_config accepts it)
        if cfg.boundary_trigger and cfg.refreshes_selection and not self.has_boundary and cfg.mode != "lossless":
            raise ValueError(
                "sfi-vllm: the boundary trigger needs sentence-ender token ids: serve with a "
                "tokenizer, set sfi.boundary_token_ids, or set sfi.boundary_trigger=false"
            )
        refresh = cfg.refreshes_selection
        self.reuse_budget[slot] = cfg.reuse_budget if refresh else np.iinfo(np.int32).max
        self.min_gap[slot] = cfg.min_gap
        self.boundary_on[slot] = cfg.boundary_trigger and refresh and self.has_boundary
        self.at_ender[slot] = cfg.boundary_fire == "at_ender"
        # dense: every step dense; quest: every step selects its own pages (no slow steps)
        self.dense_below[slot] = (1 << 62) if cfg.policy == "dense" else cfg.dense_below_context
        self.never_slow[slot] = cfg.policy == "quest"
        self.bridge[slot] = cfg.bridge_steps if refresh else 0
        self.bridge_selected[slot] = cfg.bridge_attention == "selected"
        self.stagger[slot] = cfg.reuse_stagger and refresh
        self.phase[slot] = phase

    def _bridge_until(self, slots: np.ndarray, context_lens: np.ndarray) -> np.ndarray:
        """The context length at which each row's bridge ends (set at its first decode step)."""
        return np.where(self.fresh[slots], context_lens + self.bridge[slots], self.bridge_until[slots])

    def _dense(self, slots: np.ndarray, context_lens: np.ndarray, until: np.ndarray) -> np.ndarray:
        """Rows that attend densely: below ``dense_below_context``, or inside a dense bridge."""
        return (context_lens < self.dense_below[slots]) | ((context_lens < until) & ~self.bridge_selected[slots])

    def _tokens(self, tokens: Any) -> np.ndarray:
        return np.clip(_host(tokens, np.int64), 0, self.vocab_size - 1)

    def keep_dense(self, slot: int) -> None:
        """Every decode step of ``slot`` dense, whatever its context (a request in a slot without a
        compact set: one that the controller expects to stay below its ``dense_below_context``)."""
        self.dense_below[slot] = 1 << 62

    def reset(self, slots: Any) -> None:
        """A request started, was preempted or finished: its next decode step is a first step."""
        slots = _host(slots, np.int64)
        self.fast_since_slow[slots] = 0
        self.offset[slots] = 0
        self.pending[slots] = False
        self.initialized[slots] = False
        self.fresh[slots] = True
        self.bridge_until[slots] = 0
        self.bridge_open[slots] = False

    def needs_token(self, slots: Any, context_lens: Any) -> np.ndarray:
        """Rows whose decision this step depends on their input token: the boundary trigger is on
        and past its minimum gap, and no token-independent trigger (first step, reuse budget,
        dense range, never-slow policy) decides the step anyway."""
        slots = _host(slots, np.int64)
        context_lens = _host(context_lens, np.int64)
        fast_since = self.fast_since_slow[slots]
        until = self._bridge_until(slots, context_lens)
        dense = self._dense(slots, context_lens, until)
        bridge_end = self.bridge_open[slots] & ~self.fresh[slots] & (context_lens >= until)
        return (self.boundary_on[slots] & self.initialized[slots] & ~dense & ~self.never_slow[slots] & ~bridge_end
                & (fast_since >= self.min_gap[slots])
                & (fast_since.astype(np.int64) + self.offset[slots] < self.reuse_budget[slots]))

    def step(
        self, slots: Any, tokens: Any, context_lens: Any,
        known: Any | None = None, allow_unknown: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decide and advance one decode step for each row.

        ``slots``: request slots; ``tokens``: each row's input token (the last sampled one);
        ``context_lens``: tokens in the KV cache including this step's. Returns ``(mode, reason)``
        as int8 tensors of :class:`StepMode` and :class:`SlowReason` values.

        ``known`` (bool per row, default all): rows whose token is not given. Their decision must
        not depend on it (:meth:`needs_token` false); their boundary state is left as it was and
        must be brought up to date with :meth:`replay` before the row's next step that has its
        token, in token order (:class:`DeferredTokens` does this). With ``allow_unknown`` (the
        lagged reads of :class:`LaggedTokens`) an unknown row may need its token: its boundary
        check is skipped for this step.
        """
        slots = _host(slots, np.int64)
        tokens = self._tokens(tokens)
        context_lens = _host(context_lens, np.int64)
        if known is not None:
            known = _host(known, bool)
            if not allow_unknown and bool((self.needs_token(slots, context_lens) & ~known).any()):
                raise RuntimeError("sfi-vllm: a decode row's boundary check needs its token; this is a bug")

        fast_since = self.fast_since_slow[slots].astype(np.int64)
        pending = self.pending[slots]
        is_ender = self.ender[tokens]
        is_skip = self.skip[tokens]
        at_ender = self.at_ender[slots]
        boundary = np.where(at_ender, is_ender, pending & ~is_skip)
        new_pending = ~at_ender & (is_ender | (pending & is_skip))
        if known is not None:
            boundary = boundary & known
            new_pending = np.where(known, new_pending, pending)
        boundary = boundary & self.boundary_on[slots]

        fresh = self.fresh[slots]
        until = self._bridge_until(slots, context_lens)
        self.bridge_until[slots] = until
        self.fresh[slots] = False
        dense = self._dense(slots, context_lens, until)
        # a selected bridge opens at a fresh row's first step and ends at the first step past it
        bridge_open = np.where(fresh, self.bridge_selected[slots] & (context_lens < until), self.bridge_open[slots])
        bridge_end = bridge_open & ~fresh & (context_lens >= until) & ~dense & ~self.never_slow[slots]
        self.bridge_open[slots] = bridge_open & ~bridge_end
        first = ~self.initialized[slots]
        budget = self.reuse_budget[slots]
        reuse = fast_since + self.offset[slots] >= budget
        bound = boundary & (fast_since >= self.min_gap[slots])
        slow = ~dense & (first | reuse | bound | bridge_end) & ~self.never_slow[slots]

        reason = np.full(len(slots), int(SlowReason.NONE), dtype=np.int8)
        reason[slow & bound] = int(SlowReason.BOUNDARY)
        reason[slow & reuse] = int(SlowReason.REUSE_BUDGET)
        reason[slow & bridge_end] = int(SlowReason.BRIDGE_END)
        reason[slow & first] = int(SlowReason.FIRST_DECODE)
        mode = np.full(len(slots), int(StepMode.FAST), dtype=np.int8)
        mode[slow] = int(StepMode.SLOW)
        mode[dense] = int(StepMode.DENSE)

        self.fast_since_slow[slots] = np.where(slow | dense, 0, fast_since + 1)
        # the offset shortens only the interval that follows a first selection (proper: not the
        # provisional one that opens a selected bridge). self.bridge_open is already this step's
        # state: still open after a provisional FIRST_DECODE, closed at BRIDGE_END, and closed at a
        # FIRST_DECODE that also ends the bridge (a dense range that outlasted it)
        first_slow = slow & ((first & ~self.bridge_open[slots]) | bridge_end) & self.stagger[slots]
        self.offset[slots] = np.where(first_slow, reuse_offset(context_lens, budget, self.phase[slots]),
                                      np.where(slow | dense, 0, self.offset[slots]))
        self.initialized[slots] = ~dense
        if known is None:
            self.pending[slots] = new_pending & ~dense
        else:  # unknown rows: replay() applies their token and this step's dense flag later
            self.pending[slots] = np.where(known, new_pending & ~dense, pending)
        return torch.from_numpy(mode), torch.from_numpy(reason)

    def replay(self, slots: Any, tokens: Any, context_lens: Any) -> None:
        """The boundary-state update that :meth:`step` left out for rows with unknown tokens."""
        slots = _host(slots, np.int64)
        tokens = self._tokens(tokens)
        pending = self.pending[slots]
        new_pending = ~self.at_ender[slots] & (self.ender[tokens] | (pending & self.skip[tokens]))
        context_lens = _host(context_lens, np.int64)
        dense = self._dense(slots, context_lens, self.bridge_until[slots])
        self.pending[slots] = new_pending & ~dense


class DeferredTokens:
    """Run the trigger without reading each step's tokens to the host when no decision needs them.

    The tokens a step's plan reads were sampled on the GPU; reading them to the host waits for the
    previous step to finish (a device sync that also stalls vLLM's async scheduling). Most steps do
    not need them: inside a row's minimum gap after a slow step, or with the boundary trigger off,
    no token can change a decision. Those steps keep their token tensor (device memory, no copy);
    the first step whose decision needs a token reads every kept tensor and its own in one copy and
    replays the kept ones in order first (:meth:`SlowStepTrigger.replay`), so the decisions are
    exactly those of reading every token at once. Kept tokens of a slot whose request was reset
    since (generation changed) are dropped; after ``max_steps`` kept steps they are read anyway.
    """

    def __init__(self, trigger: SlowStepTrigger, max_steps: int = 256) -> None:
        self.trigger = trigger
        self.max_steps = max_steps
        self.kept: list[tuple[torch.Tensor, list[int], list[int], list[int], list[int]]] = []
        self.reads = 0  # host reads of tokens (each a device sync when the tokens live on a GPU)
        self.steps = 0

    def step(self, slots: list[int], generations: list[int], tokens: torch.Tensor, rows: list[int],
             contexts: list[int], current_generation: list[int], defer: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Decide one step (see :meth:`SlowStepTrigger.step`) for the decode rows whose input
        tokens are ``tokens[rows[j]]`` (``tokens`` on any device, not indexed until read);
        ``current_generation`` is the controller's per-slot generation list."""
        st, ct = torch.tensor(slots), torch.tensor(contexts)
        self.steps += 1
        if defer and len(self.kept) < self.max_steps and not bool(self.trigger.needs_token(st, ct).any()):
            self.kept.append((tokens, list(rows), list(slots), list(generations), list(contexts)))
            unknown = torch.zeros(len(slots), dtype=torch.bool)
            return self.trigger.step(st, torch.zeros(len(slots), dtype=torch.long), ct, known=unknown)
        host = self._read(tokens, current_generation)
        return self.trigger.step(st, host[torch.tensor(rows, dtype=torch.long)], ct)

    def _read(self, tokens: torch.Tensor, current_generation: list[int]) -> torch.Tensor:
        """One host copy of the kept token tensors and ``tokens``; replays the kept steps; returns
        ``tokens`` on the host."""
        parts = [t for t, *_ in self.kept] + [tokens]
        self.reads += 1
        flat = torch.cat([t.reshape(-1).to(torch.long) for t in parts]).to("cpu")
        at = 0
        for t, rows, slots, gens, ctxs in self.kept:
            vals = flat[at:at + t.numel()]
            at += t.numel()
            live = [j for j, (s, g) in enumerate(zip(slots, gens)) if current_generation[s] == g]
            if live:
                self.trigger.replay(torch.tensor([slots[j] for j in live]), vals[[rows[j] for j in live]],
                                    torch.tensor([ctxs[j] for j in live]))
        self.kept.clear()
        return flat[at:]


class LaggedTokens:
    """``boundary_read = "lagged"``: the trigger sees each row's input token one decode step late,
    and no step waits for the step before it.

    At each step the rows' input tokens (on the GPU, produced by the previous step) are copied to
    pinned host memory with a non-blocking copy, and an event marks its end. At the row's next
    decode step that copy is used: it was enqueued before the previous step's forward pass, so by
    the time the host plans the next step it has (almost always) finished, and waiting for its
    event costs nothing, where an exact read waits for the whole previous step. The trigger is
    fed the previous input token as if it were this step's, so every token is seen once, in order,
    one step late: a boundary slow step fires one token after the exact rule would. A row with no
    earlier decode step in its current generation (a first step, after a reset) has no token this
    step; its boundary check is skipped (its first step is slow anyway).
    """

    def __init__(self, trigger: SlowStepTrigger) -> None:
        self.trigger = trigger
        # slot -> (generation, host tensor, index in it, event or None): the row's last input token
        self.last: dict[int, tuple[int, torch.Tensor, int, Any]] = {}
        self.reads = 0  # event waits (each would be a device sync if its copy were not done)
        self.waits = 0  # of those, the ones whose copy had not finished when the step was planned
        self.steps = 0

    def _start_copy(self, tokens: torch.Tensor) -> tuple[torch.Tensor, Any]:
        flat = tokens.reshape(-1)
        if flat.device.type != "cuda":
            return flat.to("cpu", torch.long).clone(), None
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def step(self, slots: list[int], generations: list[int], tokens: torch.Tensor, rows: list[int],
             contexts: list[int], current_generation: list[int], defer: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Same arguments as :meth:`DeferredTokens.step` (``defer`` is ignored)."""
        self.steps += 1
        lagged = np.zeros(len(slots), dtype=np.int64)
        known = np.zeros(len(slots), dtype=bool)
        # the rows' earlier tokens, grouped by the copy that holds them (nearly always one: the
        # previous step's), read with one indexing per copy
        copies: dict[int, tuple[torch.Tensor, Any, list[int], list[int]]] = {}
        for j, (s, g) in enumerate(zip(slots, generations)):
            prev = self.last.get(s)
            if prev is None or prev[0] != g or current_generation[s] != g:
                continue
            _, host, idx, event = prev
            copy = copies.get(id(host))
            if copy is None:
                copy = copies[id(host)] = (host, event, [], [])
            copy[2].append(j)
            copy[3].append(idx)
        for host, event, rows_here, idxs in copies.values():
            if event is not None:
                self.reads += 1
                if not event.query():
                    self.waits += 1
                event.synchronize()
            lagged[rows_here] = host[idxs].numpy()
            known[rows_here] = True
        mode, reason = self.trigger.step(slots, lagged, contexts, known=known, allow_unknown=True)
        host, event = self._start_copy(tokens)
        for s, g, r in zip(slots, generations, rows):
            self.last[s] = (g, host, r, event)
        return mode, reason


def token_reader(mode: str, device_type: str, trigger: SlowStepTrigger) -> DeferredTokens | LaggedTokens:
    """The reader of the sampled tokens for ``boundary_read = mode`` when the tokens live on
    ``device_type``: ``auto`` is ``lagged`` on a GPU (an exact read there is a device sync that
    waits for the previous step; measured on the H200 at batch 1 with the boundary trigger: 8K
    +6.3%, 32K +7.4% decode tok/s, ``benchmarks/results/e2e-h200.md``) and ``exact`` on the CPU,
    where reading a token costs nothing."""
    if mode == "auto":
        mode = "exact" if device_type == "cpu" else "lagged"
    if mode == "lagged":
        return LaggedTokens(trigger)
    if mode == "exact":
        return DeferredTokens(trigger)
    raise ValueError(f"boundary_read must be auto, exact or lagged, not {mode!r}")
