import numpy as np
import pytest
import torch

from sfi_vllm.config import build_config
from sfi_vllm.trigger import (
    BoundaryTokens,
    SlowReason,
    SlowStepTrigger,
    StepMode,
    boundary_tokens_from_tokenizer,
    classify_token_text,
    reuse_offset,
)

END, NL, WORD, SPACE = 1, 2, 3, 4
BOUNDARY = BoundaryTokens(frozenset({END, NL}), frozenset({NL, SPACE}))


def run(cfg, tokens, context_start=1000, slot=0):
    trig = SlowStepTrigger(cfg, num_slots=4, vocab_size=8, boundary=BOUNDARY)
    out = []
    for i, t in enumerate(tokens):
        m, r = trig.step(torch.tensor([slot]), torch.tensor([t]), torch.tensor([context_start + i]))
        out.append((StepMode(int(m[0])), SlowReason(int(r[0]))))
    return trig, out


def test_first_decode_then_reuse_budget():
    cfg = build_config({"bridge_steps": 0, "reuse_budget": 5, "min_gap": 2, "reuse_stagger": False}, use_env=False)
    _, out = run(cfg, [WORD] * 13)
    modes = [m for m, _ in out]
    assert out[0] == (StepMode.SLOW, SlowReason.FIRST_DECODE)
    assert modes[1:6] == [StepMode.FAST] * 5
    assert out[6] == (StepMode.SLOW, SlowReason.REUSE_BUDGET)
    assert out[12] == (StepMode.SLOW, SlowReason.REUSE_BUDGET)


def test_reuse_stagger_spreads_requests_that_start_together():
    """Eight requests decoding in lockstep with prompts one token apart: without the stagger every
    reuse-budget slow step falls on the same step for all of them; with it the first interval of
    each is shortened by its own offset, later intervals are the full budget, and no step has more
    than two of them slow."""
    budget, rows, steps = 20, 8, 100
    slow_at = {}
    for stagger in (False, True):
        cfg = build_config({"bridge_steps": 0, "reuse_budget": budget, "boundary_trigger": False,
                            "reuse_stagger": stagger}, use_env=False)
        assert cfg.reuse_stagger is stagger
        trig = SlowStepTrigger(cfg, num_slots=rows, vocab_size=8, boundary=BOUNDARY)
        slots = torch.arange(rows)
        base = torch.arange(rows) + 32768
        modes = [trig.step(slots, torch.full((rows,), WORD), base + i)[0] for i in range(steps)]
        slow_at[stagger] = [[i for i in range(steps) if modes[i][r] == StepMode.SLOW] for r in range(rows)]
    assert all(s == [0, 21, 42, 63, 84] for s in slow_at[False])
    per_step = [sum(i in s for s in slow_at[True]) for i in range(1, steps)]
    assert max(per_step) <= 2
    firsts = {s[1] for s in slow_at[True]}
    assert len(firsts) >= 6  # the second slow steps are spread
    for s in slow_at[True]:
        assert s[0] == 0 and 1 <= s[1] <= 21  # first selection, then a shortened first interval
        assert all(b - a == budget + 1 for a, b in zip(s[1:], s[2:]))  # then the full budget


def test_reuse_stagger_spreads_prompts_of_one_length_by_their_tokens():
    """Eight requests of one length that start together (a benchmark's fixed input length): their
    prompts' phase keys set the first intervals apart, as the lengths do for different lengths;
    the same prompt keeps the same phase, and without keys (0) they all share one."""
    from sfi_vllm.trigger import prompt_phase

    budget, rows, steps = 20, 8, 60
    prompts = [[7, 11, 13] * 100 + [r] for r in range(rows)]  # one length, the last token differs
    phases = [prompt_phase(p) for p in prompts]
    assert len(set(phases)) == rows and phases[3] == prompt_phase(list(prompts[3]))
    assert prompt_phase([]) == 0 and prompt_phase(None) == 0
    cfg = build_config({"bridge_steps": 0, "reuse_budget": budget, "boundary_trigger": False}, use_env=False)
    second = {}
    for keyed in (False, True):
        trig = SlowStepTrigger(cfg, num_slots=rows, vocab_size=8, boundary=BOUNDARY)
        for r in range(rows):
            trig.configure(r, cfg, phases[r] if keyed else 0)
        slots, ctx = torch.arange(rows), torch.full((rows,), 16384)
        modes = [trig.step(slots, torch.full((rows,), WORD), ctx + i)[0] for i in range(steps)]
        second[keyed] = [[i for i in range(steps) if modes[i][r] == StepMode.SLOW][1] for r in range(rows)]
    assert len(set(second[False])) == 1  # one length, no keys: one phase
    assert len(set(second[True])) >= 5, second[True]


def test_reuse_offset_is_in_range_and_per_context():
    from sfi_vllm.trigger import reuse_offset

    ctx = torch.arange(1, 5000)
    for b in (1, 2, 7, 64):
        off = reuse_offset(ctx, torch.full_like(ctx, b, dtype=torch.int32))
        assert int(off.min()) >= 0 and int(off.max()) <= b - 1
        if b > 1:
            assert len(set(off.tolist())) == b  # every phase is used


def test_boundary_fires_on_first_token_after_ender_and_skips_newlines():
    cfg = build_config({"bridge_steps": 0, "reuse_budget": 50, "min_gap": 3}, use_env=False)
    toks = [WORD, WORD, WORD, WORD, END, NL, SPACE, WORD, WORD]
    _, out = run(cfg, toks)
    assert [m for m, _ in out][:7] == [StepMode.SLOW] + [StepMode.FAST] * 6
    assert out[7] == (StepMode.SLOW, SlowReason.BOUNDARY)
    assert out[8][0] == StepMode.FAST


def test_boundary_at_ender_mode():
    cfg = build_config({"bridge_steps": 0, "reuse_budget": 50, "min_gap": 3, "boundary_fire": "at_ender"}, use_env=False)
    _, out = run(cfg, [WORD, WORD, WORD, WORD, END, WORD])
    assert out[4] == (StepMode.SLOW, SlowReason.BOUNDARY)
    assert out[5][0] == StepMode.FAST


def test_boundary_inside_min_gap_is_dropped():
    cfg = build_config({"bridge_steps": 0, "reuse_budget": 50, "min_gap": 4}, use_env=False)
    toks = [WORD, END, WORD, WORD, WORD, WORD, WORD]
    _, out = run(cfg, toks)
    assert all(m == StepMode.FAST for m, _ in out[1:])


def test_boundary_trigger_off():
    cfg = build_config({"bridge_steps": 0, "reuse_budget": 50, "min_gap": 0, "boundary_trigger": False}, use_env=False)
    _, out = run(cfg, [WORD, END, WORD, END, WORD])
    assert all(m == StepMode.FAST for m, _ in out[1:])


def test_dense_below_context_then_first_slow():
    cfg = build_config({"bridge_steps": 0, "dense_below_context": 1003}, use_env=False)
    _, out = run(cfg, [WORD] * 5, context_start=1000)
    assert [m for m, _ in out] == [StepMode.DENSE] * 3 + [StepMode.SLOW, StepMode.FAST]
    assert out[3][1] == SlowReason.FIRST_DECODE


def test_reset_and_slots_are_independent():
    cfg = build_config({"bridge_steps": 0, "reuse_budget": 3, "min_gap": 0, "reuse_stagger": False}, use_env=False)
    trig = SlowStepTrigger(cfg, num_slots=4, vocab_size=8, boundary=BOUNDARY)
    slots = torch.tensor([0, 2])
    toks = torch.tensor([WORD, WORD])
    m, _ = trig.step(slots, toks, torch.tensor([100, 100]))
    assert m.tolist() == [StepMode.SLOW, StepMode.SLOW]
    m, _ = trig.step(slots, toks, torch.tensor([101, 101]))
    assert m.tolist() == [StepMode.FAST, StepMode.FAST]
    trig.reset(torch.tensor([2]))
    m, r = trig.step(slots, toks, torch.tensor([102, 102]))
    assert m.tolist() == [StepMode.FAST, StepMode.SLOW] and r[1] == SlowReason.FIRST_DECODE


def test_boundary_trigger_needs_token_ids():
    cfg = build_config({"bridge_steps": 0, }, use_env=False)
    with pytest.raises(ValueError, match="boundary_token_ids"):
        SlowStepTrigger(cfg, 2, 8, boundary=None)


@pytest.mark.parametrize(
    "text,newline,expect",
    [
        (".", True, (True, False)),
        (" .", True, (True, False)),
        ("?!", True, (True, False)),
        (".\n\n", True, (True, False)),
        ("。", True, (True, False)),
        ('."', True, (True, False)),
        ("\n", True, (True, True)),
        ("\n", False, (False, True)),
        (" ", True, (False, True)),
        ("Mr", True, (False, False)),
        ("3.14", True, (False, False)),
        (",", True, (False, False)),
    ],
)
def test_classify_token_text(text, newline, expect):
    assert classify_token_text(text, newline) == expect


def test_boundary_set_from_a_real_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "Hello": 1, ".": 2, "?": 3, "\n": 4, ".\n": 5, "world": 6, "。": 7, ",": 8}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    b = boundary_tokens_from_tokenizer(hf, newline_is_boundary=True)
    assert b.enders == {2, 3, 4, 5, 7}
    assert b.skips == {4}


# per-slot trigger settings of the randomised stream tests: boundary modes, gaps, budgets, trigger
# off, a dense range, Quest
MIXED_SLOT_CONFIGS = (
    {"reuse_budget": 12, "min_gap": 4, "bridge_steps": 3},
    {"reuse_budget": 30, "min_gap": 8, "boundary_fire": "at_ender"},
    {"reuse_budget": 9, "min_gap": 0, "bridge_steps": 6, "bridge_attention": "selected"},
    {"boundary_trigger": False, "reuse_budget": 7, "min_gap": 2},
    {"reuse_budget": 20, "min_gap": 5, "dense_below_context": 1010},
    {"policy": "quest"},
)


@pytest.mark.parametrize("seed", range(6))
def test_deferred_tokens_decide_exactly_as_reading_every_token(seed):
    """DeferredTokens (tokens read only when a decision needs them) against the trigger fed every
    token: random token streams, per-slot configs (boundary modes, gaps, budgets, dense range,
    trigger off, Quest), rows joining, leaving and being reset mid-stream."""
    from sfi_vllm.trigger import DeferredTokens

    g = torch.Generator().manual_seed(seed)
    cfgs = [build_config({"bridge_steps": 0, **c}, use_env=False) for c in MIXED_SLOT_CONFIGS]
    slots = 6
    eager = SlowStepTrigger(cfgs[0], num_slots=slots, vocab_size=8, boundary=BOUNDARY)
    lazy = SlowStepTrigger(cfgs[0], num_slots=slots, vocab_size=8, boundary=BOUNDARY)
    deferred = DeferredTokens(lazy, max_steps=40)
    generation = [0] * slots
    context = [1000] * slots
    for s in range(slots):
        for t in (eager, lazy):
            t.configure(s, cfgs[s])
    skipped_reads = 0
    for step in range(400):
        if step % 37 == 11:  # a request ends and another takes its slot: reset
            s = int(torch.randint(0, slots, (1,), generator=g))
            generation[s] += 1
            context[s] = 1000
            for t in (eager, lazy):
                t.reset(torch.tensor([s]))
        active = [s for s in range(slots) if torch.rand(1, generator=g) < 0.8]
        if not active:
            continue
        # tokens of all "rows" of the step (some rows are not decode rows: their entries are noise)
        rows = sorted(torch.randperm(len(active) + 2, generator=g)[: len(active)].tolist())
        all_tokens = torch.randint(1, 6, (len(active) + 2,), generator=g)
        ctx = [context[s] for s in active]
        m1, r1 = eager.step(torch.tensor(active), all_tokens[rows], torch.tensor(ctx))
        before = deferred.reads
        m2, r2 = deferred.step(active, [generation[s] for s in active], all_tokens, rows, ctx, generation, defer=True)
        skipped_reads += deferred.reads == before
        assert torch.equal(m1, m2) and torch.equal(r1, r2), step
        for s in active:
            context[s] += 1
    assert np.array_equal(eager.pending, lazy.pending) or deferred.kept  # kept steps not replayed yet
    assert skipped_reads > 10, skipped_reads  # a mixed batch rarely has no row past its gap


def test_deferred_tokens_one_request_reads_only_past_the_gap():
    """One request, the default gap (16) and budget (64), sentences of 10-40 tokens: the tokens
    of the steps inside the gap are never read on their own."""
    from sfi_vllm.trigger import DeferredTokens

    g = torch.Generator().manual_seed(0)
    cfg = build_config({"bridge_steps": 0, }, use_env=False)
    eager = SlowStepTrigger(cfg, num_slots=1, vocab_size=8, boundary=BOUNDARY)
    lazy = SlowStepTrigger(cfg, num_slots=1, vocab_size=8, boundary=BOUNDARY)
    deferred = DeferredTokens(lazy)
    stream = []
    while len(stream) < 2000:
        stream += [WORD] * int(torch.randint(10, 40, (1,), generator=g)) + [END]
    for i, tok in enumerate(stream):
        m1, r1 = eager.step(torch.tensor([0]), torch.tensor([tok]), torch.tensor([1000 + i]))
        m2, r2 = deferred.step([0], [0], torch.tensor([tok]), [0], [1000 + i], [0], defer=True)
        assert torch.equal(m1, m2) and torch.equal(r1, r2), i
    assert deferred.reads < 0.6 * deferred.steps, (deferred.reads, deferred.steps)


def test_deferred_tokens_never_read_without_the_boundary_trigger():
    from sfi_vllm.trigger import DeferredTokens

    cfg = build_config({"bridge_steps": 0, "boundary_trigger": False, "reuse_budget": 5, "min_gap": 0}, use_env=False)
    trig = SlowStepTrigger(cfg, num_slots=2, vocab_size=8, boundary=BOUNDARY)
    deferred = DeferredTokens(trig, max_steps=1000)
    for i in range(50):
        deferred.step([0, 1], [0, 0], torch.tensor([END, WORD]), [0, 1], [1000 + i] * 2, [0, 0], defer=True)
    assert deferred.reads == 0 and deferred.steps == 50


def test_lagged_tokens_fire_one_token_after_the_exact_rule():
    from sfi_vllm.trigger import DeferredTokens, LaggedTokens

    cfg = build_config({"bridge_steps": 0, "reuse_budget": 50, "min_gap": 3}, use_env=False)
    toks = [WORD, WORD, WORD, WORD, END, NL, SPACE, WORD, WORD, WORD]
    out = {}
    for name, cls in (("exact", DeferredTokens), ("lagged", LaggedTokens)):
        reader = cls(SlowStepTrigger(cfg, num_slots=1, vocab_size=8, boundary=BOUNDARY))
        out[name] = [reader.step([0], [0], torch.tensor([t]), [0], [1000 + i], [0], defer=False)
                     for i, t in enumerate(toks)]
    slow = {k: [i for i, (m, _) in enumerate(v) if int(m[0]) == StepMode.SLOW] for k, v in out.items()}
    assert slow == {"exact": [0, 7], "lagged": [0, 8]}
    assert int(out["lagged"][8][1][0]) == SlowReason.BOUNDARY


def test_boundary_read_auto_is_lagged_on_a_gpu_and_exact_on_the_cpu():
    from sfi_vllm.trigger import DeferredTokens, LaggedTokens, token_reader

    assert build_config({"bridge_steps": 0, }, use_env=False).boundary_read == "auto"
    trig = SlowStepTrigger(build_config({"bridge_steps": 0, }, use_env=False), num_slots=1, vocab_size=8, boundary=BOUNDARY)
    kinds = {(mode, dev): type(token_reader(mode, dev, trig))
             for mode in ("auto", "exact", "lagged") for dev in ("cpu", "cuda")}
    assert kinds == {("auto", "cpu"): DeferredTokens, ("auto", "cuda"): LaggedTokens,
                     ("exact", "cpu"): DeferredTokens, ("exact", "cuda"): DeferredTokens,
                     ("lagged", "cpu"): LaggedTokens, ("lagged", "cuda"): LaggedTokens}
    with pytest.raises(ValueError, match="boundary_read"):
        token_reader("sometimes", "cpu", trig)


@pytest.mark.parametrize("seed", range(4))
def test_lagged_tokens_feed_every_row_its_previous_token(seed):
    """LaggedTokens against the trigger fed, at each row's decode step, the input token of that
    row's previous decode step (none at the first step of a generation): random streams, per-slot
    configs, rows skipping steps, resets."""
    from sfi_vllm.trigger import LaggedTokens

    g = torch.Generator().manual_seed(seed)
    cfgs = [build_config({"bridge_steps": 0, **c}, use_env=False) for c in MIXED_SLOT_CONFIGS[:4]]  # no dense range, no Quest
    slots = len(cfgs)
    ref = SlowStepTrigger(cfgs[0], num_slots=slots, vocab_size=8, boundary=BOUNDARY)
    lagged = LaggedTokens(SlowStepTrigger(cfgs[0], num_slots=slots, vocab_size=8, boundary=BOUNDARY))
    for s in range(slots):
        for t in (ref, lagged.trigger):
            t.configure(s, cfgs[s])
    generation, context, prev = [0] * slots, [1000] * slots, [None] * slots
    boundaries = 0
    for step in range(300):
        if step % 41 == 17:
            s = int(torch.randint(0, slots, (1,), generator=g))
            generation[s] += 1
            context[s], prev[s] = 1000, None
            for t in (ref, lagged.trigger):
                t.reset(torch.tensor([s]))
        active = [s for s in range(slots) if torch.rand(1, generator=g) < 0.8]
        if not active:
            continue
        rows = sorted(torch.randperm(len(active) + 1, generator=g)[: len(active)].tolist())
        all_tokens = torch.randint(1, 6, (len(active) + 1,), generator=g)
        known = torch.tensor([prev[s] is not None for s in active])
        shifted = torch.tensor([prev[s] or 0 for s in active])
        m1, r1 = ref.step(torch.tensor(active), shifted, torch.tensor([context[s] for s in active]),
                          known=known, allow_unknown=True)
        m2, r2 = lagged.step(active, [generation[s] for s in active], all_tokens, rows,
                             [context[s] for s in active], generation, defer=True)
        assert torch.equal(m1, m2) and torch.equal(r1, r2), step
        boundaries += int((r2 == SlowReason.BOUNDARY).sum())
        for s, r in zip(active, rows):
            context[s] += 1
            prev[s] = int(all_tokens[r])
    assert boundaries > 5, boundaries
    assert lagged.waits == 0  # on the CPU the copies are synchronous: nothing to wait for


def test_bridge_decodes_densely_then_selects_and_restarts_after_a_reset():
    """The first bridge_steps decode steps after a prefill are dense (no boundary can fire in
    them), the next is the first slow step; a reset (new prefill, preemption) starts a new bridge;
    policies that do not refresh (snapkv) have no bridge."""
    cfg = build_config({"bridge_steps": 3, "reuse_budget": 50, "min_gap": 0}, use_env=False)
    trig, out = run(cfg, [WORD, END, WORD, WORD, END, WORD])
    assert [m for m, _ in out] == [StepMode.DENSE] * 3 + [StepMode.SLOW, StepMode.FAST, StepMode.SLOW]
    assert out[3][1] == SlowReason.FIRST_DECODE and out[5][1] == SlowReason.BOUNDARY
    trig.reset(torch.tensor([0]))
    modes = [StepMode(int(trig.step(torch.tensor([0]), torch.tensor([WORD]), torch.tensor([5000 + i]))[0][0]))
             for i in range(5)]
    assert modes == [StepMode.DENSE] * 3 + [StepMode.SLOW, StepMode.FAST]
    snap = build_config({"policy": "snapkv", "bridge_steps": 3}, use_env=False)
    _, out = run(snap, [WORD] * 3)
    assert [m for m, _ in out] == [StepMode.SLOW, StepMode.FAST, StepMode.FAST]


def test_selected_bridge_selects_at_its_start_and_again_at_its_end():
    """bridge_attention selected: the first step is a slow step (a provisional set), the bridge's
    steps are fast (a boundary after min_gap still fires), the first step past the bridge is a
    BRIDGE_END slow step that attends densely and refreshes every layer, and the reuse stagger's
    offset is drawn there, not at the provisional selection; a reset opens a new bridge."""
    cfg = build_config({"bridge_steps": 4, "bridge_attention": "selected", "reuse_budget": 50, "min_gap": 2,
                        "reuse_stagger": False}, use_env=False)
    trig, out = run(cfg, [WORD, WORD, WORD, END, WORD, WORD, WORD, END, WORD])
    assert out == [(StepMode.SLOW, SlowReason.FIRST_DECODE), (StepMode.FAST, SlowReason.NONE),
                   (StepMode.FAST, SlowReason.NONE), (StepMode.FAST, SlowReason.NONE),
                   (StepMode.SLOW, SlowReason.BRIDGE_END),  # a boundary on the same step: the bridge's end
                   (StepMode.FAST, SlowReason.NONE), (StepMode.FAST, SlowReason.NONE),
                   (StepMode.FAST, SlowReason.NONE), (StepMode.SLOW, SlowReason.BOUNDARY)]
    # a sentence end inside a longer bridge re-selects the provisional set (past min_gap), and the
    # bridge still ends at its length
    longer = cfg.model_copy(update={"bridge_steps": 8})
    _, out = run(longer, [WORD, WORD, WORD, END, WORD, WORD, WORD, WORD, WORD, WORD])
    assert [r for _, r in out] == [SlowReason.FIRST_DECODE, SlowReason.NONE, SlowReason.NONE, SlowReason.NONE,
                                   SlowReason.BOUNDARY, SlowReason.NONE, SlowReason.NONE, SlowReason.NONE,
                                   SlowReason.BRIDGE_END, SlowReason.NONE]
    # a reuse budget shorter than the bridge re-selects inside it too
    short = build_config({"bridge_steps": 6, "bridge_attention": "selected", "reuse_budget": 2, "min_gap": 0,
                          "reuse_stagger": False, "boundary_trigger": False}, use_env=False)
    _, out = run(short, [WORD] * 8)
    assert [r for _, r in out] == [SlowReason.FIRST_DECODE, SlowReason.NONE, SlowReason.NONE,
                                   SlowReason.REUSE_BUDGET, SlowReason.NONE, SlowReason.NONE,
                                   SlowReason.BRIDGE_END, SlowReason.NONE]
    trig.reset(torch.tensor([0]))
    got = [SlowReason(int(trig.step(torch.tensor([0]), torch.tensor([WORD]), torch.tensor([7000 + i]))[1][0]))
           for i in range(6)]
    assert got == [SlowReason.FIRST_DECODE] + [SlowReason.NONE] * 3 + [SlowReason.BRIDGE_END, SlowReason.NONE]
    # without a bridge the setting changes nothing
    plain = build_config({"bridge_steps": 0, "reuse_budget": 3, "min_gap": 0, "reuse_stagger": False}, use_env=False)
    sel = plain.model_copy(update={"bridge_attention": "selected"})
    assert run(plain, [WORD] * 9)[1] == run(sel, [WORD] * 9)[1]
    # the stagger: the reuse interval after BRIDGE_END is shortened, the bridge itself is not
    stag = build_config({"bridge_steps": 4, "bridge_attention": "selected", "reuse_budget": 8, "min_gap": 0,
                         "boundary_trigger": False}, use_env=False)
    offsets = set()
    for start in range(1000, 1016):
        _, out = run(stag, [WORD] * 20, context_start=start)
        reasons = [r for _, r in out]
        assert reasons[:5] == [SlowReason.FIRST_DECODE] + [SlowReason.NONE] * 3 + [SlowReason.BRIDGE_END]
        offset = int(reuse_offset([start + 4], [8])[0])
        offsets.add(offset)
        assert reasons.index(SlowReason.REUSE_BUDGET) == 4 + 1 + 8 - offset, (start, reasons)
    assert len(offsets) > 4


@pytest.mark.parametrize("dense_below", [1002, 1004, 1006])
def test_selected_bridge_with_a_dense_range(dense_below):
    """A dense range (contexts below dense_below_context) that ends inside the bridge, at its end
    or after it: the first step past the range selects; a range that ends inside the bridge leaves
    it provisional until the bridge's end, one that outlasts the bridge makes it the first selection
    proper (the stagger's offset drawn there)."""
    cfg = build_config({"bridge_steps": 4, "bridge_attention": "selected", "reuse_budget": 50, "min_gap": 0,
                        "dense_below_context": dense_below, "boundary_trigger": False}, use_env=False)
    trig, out = run(cfg, [WORD] * 9)
    reasons = [r for _, r in out]
    modes = [m for m, _ in out]
    k = dense_below - 1000
    assert modes[:k] == [StepMode.DENSE] * k and out[k] == (StepMode.SLOW, SlowReason.FIRST_DECODE)
    if k < 4:
        assert reasons[k + 1:4] == [SlowReason.NONE] * (3 - k) and out[4] == (StepMode.SLOW, SlowReason.BRIDGE_END)
    assert SlowReason.BRIDGE_END not in reasons[k + 1:] if k >= 4 else reasons.count(SlowReason.BRIDGE_END) == 1
    assert int(trig.offset[0]) == int(reuse_offset([max(dense_below, 1004)], [50])[0])
    assert not trig.bridge_open[0]


def _plan_controller(sfi):
    from sfi_vllm.controller import SFIController
    from test_sfi_layer import fake_vllm_config

    return SFIController(build_config({"boundary_token_ids": [7], **sfi}, use_env=False), fake_vllm_config(sfi))


def test_the_controller_plans_a_bridge_end_as_a_first_selection():
    """At BRIDGE_END the controller plans what a dense bridge's first selection gets: the row
    attends densely (not keys-only, though slow_attention is keys and it has a set), refreshes
    every layer under layer_interleaved_refresh, and records the stagger's offset drawn there; a
    later re-selection is keys-only and refreshes half of the layers."""
    import numpy as np

    sfi = {"bridge_steps": 3, "bridge_attention": "selected", "slow_attention": "keys", "layer_interleaved_refresh": True,
           "reuse_budget": 8, "min_gap": 0, "boundary_trigger": False}
    ctl = _plan_controller(sfi)
    plans = [ctl.plan_step(["r"], np.ones(1, int), np.array([2000 + i]), [2000], torch.tensor([3]))
             for i in range(14)]
    reasons = [p.reasons[0] for p in plans]
    assert reasons[0] == SlowReason.FIRST_DECODE and reasons[3] == SlowReason.BRIDGE_END
    assert plans[0].keys_only is None and plans[0].refresh_all == [True]
    assert ctl.stats.get("r").reuse_offset == int(reuse_offset([2004], [8], [0])[0])
    assert plans[3].keys_only is None and plans[3].refresh_all == [True]
    later = [p for p in plans[4:] if p.reasons[0] == SlowReason.REUSE_BUDGET]
    assert later and later[0].keys_only == [True] and later[0].refresh_all == [False]


def test_bridge_with_lagged_and_deferred_token_reads_matches_exact_reads():
    """The bridge is decided from context lengths, so the deferred reader (tokens kept through
    the dense steps and replayed later) plans exactly what reading every token does."""
    from sfi_vllm.trigger import DeferredTokens

    cfg = build_config({"bridge_steps": 4, "reuse_budget": 50, "min_gap": 2}, use_env=False)
    tokens = [WORD, END, NL, WORD, END, WORD, WORD, WORD, END, SPACE, WORD, WORD]
    _, exact = run(cfg, tokens)
    trig = SlowStepTrigger(cfg, num_slots=4, vocab_size=8, boundary=BOUNDARY)
    reader = DeferredTokens(trig)
    deferred = []
    for i, t in enumerate(tokens):
        m, r = reader.step([0], [1], torch.tensor([t]), [0], [1000 + i], [1, 1, 1, 1], defer=True)
        deferred.append((StepMode(int(m[0])), SlowReason(int(r[0]))))
    assert deferred == exact


def test_the_runner_hook_hashes_new_requests_prompts_from_the_input_batch():
    """The phase key of a request the controller has not seen comes from the prompt tokens in
    vLLM's input batch (int32, no copy) and equals prompt_phase of its prompt; a known request's,
    or any with phases off (lossless), is 0."""
    from types import SimpleNamespace

    from sfi_vllm.patches.runner_hooks import _runner_step_inputs
    from sfi_vllm.trigger import prompt_phase

    prompts = {"a": [5, 6, 7, 8], "b": [5, 6, 7, 9, 10]}
    tokens = np.zeros((4, 16), dtype=np.int32)
    for i, r in enumerate(prompts):
        tokens[i, :len(prompts[r])] = prompts[r]
        tokens[i, len(prompts[r])] = 99  # an output token after the prompt: not hashed
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(num_reqs=2, req_ids=list(prompts), num_computed_tokens_cpu=np.array([4, 0]),
                                    token_ids_cpu=tokens),
        requests={r: SimpleNamespace(num_prompt_tokens=len(p), prompt_token_ids=p, sampling_params=None)
                  for r, p in prompts.items()},
        input_ids=SimpleNamespace(gpu=torch.arange(8)))
    out = _runner_step_inputs(runner, [1, 5])
    assert out[-1] == [prompt_phase(prompts["a"]), prompt_phase(prompts["b"])] and 0 not in out[-1]
    assert _runner_step_inputs(runner, [1, 5], known={"a"})[-1] == [0, prompt_phase(prompts["b"])]
    assert _runner_step_inputs(runner, [1, 5], phases=False)[-1] == [0, 0]
    # each request's prompt plus max_tokens: how long its context can grow (None: unknown)
    assert out[-2] == [None, None]
    runner.requests["b"].sampling_params = SimpleNamespace(extra_args=None, max_tokens=10)
    assert _runner_step_inputs(runner, [1, 5])[-2] == [None, 15]


@pytest.mark.parametrize("flash", [True, False])
def test_flash_dense_steps_marks_only_steps_whose_every_row_decodes_densely(flash):
    """``experimental.flash_dense_steps`` sends a step to the eager path (FlashAttention over all
    rows) exactly when every row is a decode row attending densely: not with a prefill row in the
    step, nor once a row re-selects or attends through its set; off, no step is sent for it."""
    sfi = {"bridge_steps": 4, "reuse_budget": 8, "min_gap": 0, "boundary_trigger": False,
           "experimental": {"flash_dense_steps": flash}}
    ctl = _plan_controller(sfi)
    prompt = [2000, 3000]
    seen = []
    for i in range(12):
        # row b's prompt is still prefilling at step 0 (a chunk of 512 tokens)
        scheduled = np.array([1, 512 if i == 0 else 1])
        computed = np.array([2000 + i, 2488 if i == 0 else 3000 + i - 1])
        plan = ctl.plan_step(["a", "b"], scheduled, computed, prompt, torch.tensor([3, 3]))
        all_dense = all(m == StepMode.DENSE for m in plan.modes)
        seen.append(all_dense)
        assert plan.flash_dense == (flash and all_dense)
        assert plan.needs_eager == (plan.flash_dense or any(plan.row_needs_eager(r) for r in range(2)))
    assert seen[0] is False and any(seen) and not all(seen)  # the prefill step, the bridge, and after
