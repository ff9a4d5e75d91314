"""Each row's geometry (sinks, window start, K, candidates): made once per plan from the row's
config and context, equal to the formulas of ``sfi_vllm.compact``, and what the step's layers
and tables read."""

import numpy as np
import pytest
import torch

from sfi_vllm.backends.common import SFILayer, fast_row_tables, make_step
from sfi_vllm.compact import RowGeometry, selected_count, window_start
from sfi_vllm.config import build_config
from sfi_vllm.controller import SFIController, StepPlan
from sfi_vllm.trigger import StepMode
from test_sfi_layer import fake_vllm_config, make_batch, plan_for

BASE = {"boundary_token_ids": [7], "min_gap": 0, "bridge_steps": 0}
CONFIGS = [
    {"sinks": 4, "recent_window": 32, "window_align": 16, "selected_tokens": 24},
    {"sinks": 4, "recent_window": 32, "window_align": 16, "selected_tokens": 24, "window_mode": "slide"},
    {"sinks": 64, "recent_window": 100, "window_align": 1, "selected_tokens": 500},
    {"sinks": 0, "recent_window": 8, "window_align": 4, "selected_fraction": 0.1, "selected_floor": 3,
     "selected_cap": 50},
    {"sinks": 4, "recent_window": 64, "policy": "streaming"},
    {"sinks": 4, "recent_window": 48, "policy": "quest", "quest_page": 16, "selected_tokens": 64},
]
CONTEXTS = [0, 1, 3, 4, 5, 40, 60, 70, 100, 164, 165, 700, 2048, 9999]


def config(extra):
    return build_config({**BASE, **extra}, use_env=False)


def test_geometry_of_a_short_and_a_long_context():
    cfg = config(CONFIGS[0])  # 4 sinks, a window of 32 aligned to 16, K 24
    # (context, sinks, window start, selected, candidates, scored)
    expected = [
        (2, 2, 2, 0, 0, False),  # fewer tokens than sinks: all sinks, no candidates
        (40, 4, 4, 0, 0, False),  # the aligned window start falls inside the sinks
        (60, 4, 16, 12, 12, False),  # K clipped to the 12 candidates: all taken, none scored
        (70, 4, 32, 24, 28, True),
        (700, 4, 656, 24, 652, True),
    ]
    for ctx, sinks, ws, k, candidates, scored in expected:
        g = RowGeometry.at(cfg, ctx)
        assert (g.context, g.sinks, g.window_start, g.selected, g.candidates, g.scored) == (
            ctx, sinks, ws, k, candidates, scored), ctx
        assert g.budget == 24


@pytest.mark.parametrize("extra", CONFIGS, ids=lambda e: "-".join(f"{k}={v}" for k, v in e.items()))
def test_geometry_equals_the_formulas(extra):
    cfg = config(extra)
    for ctx in CONTEXTS:
        g = RowGeometry.at(cfg, ctx)
        sinks = min(cfg.sinks, ctx)
        ws = window_start(cfg, ctx)
        assert (g.context, g.sinks, g.window_start, g.budget) == (ctx, sinks, ws, cfg.selected_budget(ctx))
        assert g.selected == selected_count(cfg, ctx) == max(0, min(cfg.selected_budget(ctx), ws - sinks))
        assert g.candidates == ws - sinks and g.scored == (0 < g.selected < ws - sinks)
        assert sinks <= ws <= max(ctx, sinks)
    with pytest.raises(AttributeError):
        g.selected = 1  # frozen: a plan's rows cannot drift from their context


def test_many_rows_at_once_equal_one_row_at_a_time():
    # every config beside every other, in an order that revisits each (the constants are read
    # once per config object), and a config that differs from another only in its budget's form
    cfgs = [config(extra) for extra in CONFIGS]
    cfgs.append(config({**CONFIGS[3], "selected_fraction": None, "selected_tokens": 7}))
    rng = np.random.default_rng(0)
    pairs = [(cfgs[i], int(c)) for i, c in zip(rng.integers(0, len(cfgs), 400), rng.integers(0, 3000, 400))]
    pairs += [(cfg, ctx) for cfg in cfgs for ctx in CONTEXTS]
    got = RowGeometry.many([c for c, _ in pairs], [n for _, n in pairs])
    assert got == [RowGeometry.at(c, n) for c, n in pairs]
    assert all(type(g) is RowGeometry for g in got)
    assert RowGeometry.many([], []) == []


def test_a_controller_plan_carries_each_rows_geometry_under_its_own_config():
    engine = {**BASE, "sinks": 4, "recent_window": 32, "selected_tokens": 24, "reuse_budget": 3}
    ctl = SFIController(build_config(engine, use_env=False), fake_vllm_config(engine, max_num_seqs=4))
    reqs = ["engine", "wide", "slide", "short"]
    extra = [None, {"sfi": {"sinks": 64, "recent_window": 100, "selected_tokens": 500}},
             {"sfi": {"window_mode": "slide", "selected_fraction": 0.05, "selected_floor": 8}},
             {"sfi": {"sinks": 16}}]
    # prefill (the short request's 3 tokens fewer than its 16 sinks), then a decode step
    plans = [ctl.plan_step(reqs, np.array([1000, 1000, 1000, 3]), np.zeros(4, int), [1000, 1000, 1000, 3],
                           torch.zeros(4, dtype=torch.long), extra),
             ctl.plan_step(reqs, np.ones(4, int), np.array([1000, 1000, 1000, 3]), [1000, 1000, 1000, 3],
                           torch.zeros(4, dtype=torch.long), extra)]
    assert plans[1].modes == [StepMode.SLOW] * 4
    for p in plans:
        assert len(p.geometry) == p.num_reqs == 4
        assert p.geometry == [RowGeometry.at(c, n) for c, n in zip(p.configs, p.context)]
    g = plans[1].geometry
    assert [x.context for x in g] == [1001, 1001, 1001, 4]
    assert [x.sinks for x in g] == [4, 64, 4, 4]  # each row's own sinks, clipped to its context
    assert [x.selected for x in g] == [24, 500, 50, 0]
    assert g[0].window_start == g[2].window_start == 960 and g[1].window_start == 896


def test_a_step_reads_the_plans_geometry_or_the_metadatas_lengths():
    cfg = config(CONFIGS[0])
    _, cam, _, _, _ = make_batch("flash", 16, [700, 70], [1, 1])
    with_context = plan_for([StepMode.FAST, StepMode.SLOW], cfg=cfg, context=[700, 70])
    step = make_step(with_context, cam, lambda s: None)
    assert step.geometry is with_context.geometry  # made once, with the plan
    without = plan_for([StepMode.FAST, StepMode.SLOW], cfg=cfg)
    assert without.geometry is None
    assert make_step(without, cam, lambda s: None).geometry == with_context.geometry


def test_fast_rows_window_starts_fixed_at_selection_or_sliding():
    grow, slide = config(CONFIGS[0]), config(CONFIGS[1])
    now = RowGeometry.at(grow, 700)  # window start 656
    assert SFILayer._window_start(grow, now, 640) == 640  # fixed at the slow step
    assert SFILayer._window_start(slide, now, 640) == 656  # slid up to this step's
    assert SFILayer._window_start(slide, now, 672) == 672  # never back
    plan = StepPlan(num_reqs=2, req_ids=["g", "s"], slots=[0, 1], generations=[1, 1], modes=[StepMode.FAST] * 2,
                    reasons=[0, 0], refresh_all=[False] * 2, slow_counts=[0, 0], configs=[grow, slide],
                    context=[700, 700])
    assert fast_row_tables(plan, [0, 1]).tolist() == [[0, 1], [0, 656]]
