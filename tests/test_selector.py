import math

import pytest
import torch

from sfi_vllm.config import SelectorConfig
from sfi_vllm.selector import Selector, candidate_page_mask, quest_page_bounds


def _probs(hkv, r, n, rng):
    return torch.softmax(torch.randn(hkv, r, n, generator=rng) * 3, -1)


def test_evidence_is_power_mean_over_group(rng):
    sel = Selector()
    p = _probs(3, 3, 50, rng)
    f = sel.evidence(p, 4, 40)
    for h in range(3):
        # each query row's probabilities renormalised over the candidates, then the power mean
        row_mass = [sum(p[h, r, j].item() for j in range(4, 40)) for r in range(3)]
        raw = [(sum((p[h, r, j].item() / row_mass[r]) ** 0.5 for r in range(3)) / 3) ** 2 for j in range(4, 40)]
        z = sum(raw)
        assert torch.allclose(f[h], torch.tensor([x / z for x in raw]), atol=1e-6)


def test_prior_formula(rng):
    cfg = SelectorConfig()
    sel = Selector(cfg)
    norms = torch.rand(2, 30, generator=rng) * 5 + 0.1
    log_r = sel.log_prior(norms)
    for h in range(2):
        vals = []
        for j in range(30):
            u = j / 29
            lr = cfg.w_norm * (-cfg.gamma * math.log(norms[h, j].item()))
            lr += cfg.w_pos * (-cfg.beta * u**cfg.pos_power + cfg.eta * math.log(max(1 - u, 1e-30)))
            vals.append(lr)
        ref = torch.log_softmax(torch.tensor(vals, dtype=torch.float64), 0)
        assert torch.allclose(log_r[h].double(), ref, atol=1e-4)
    assert log_r[:, -1].max() < log_r[:, 0].min() - 10  # the slot just before the window is damped


def test_fusion_lambda_is_closed_form_minimiser(rng):
    sel = Selector(SelectorConfig(lambda_max_single=1.0))
    f = torch.softmax(torch.randn(4, 64, generator=rng) * 2, -1)
    log_r = torch.log_softmax(torch.randn(4, 64, generator=rng), -1)
    log_s, lam = sel.fuse(f, log_r, multi_row=False)
    r = log_r.exp()
    for h in range(4):
        d = f[h] - r[h]
        expect = (f[h] @ d / (d @ d)).clamp(0, 1)
        assert abs(lam[h].item() - expect.item()) < 1e-5
        s = (1 - lam[h]) * f[h] + lam[h] * r[h]
        assert torch.allclose(log_s[h].exp(), s, atol=1e-6)


def test_fusion_lambda_is_clipped(rng):
    f = torch.softmax(torch.randn(3, 40, generator=rng), -1)
    log_r = torch.log_softmax(torch.randn(3, 40, generator=rng) * 4, -1)
    _, lam1 = Selector().fuse(f, log_r, multi_row=False)
    _, lam2 = Selector().fuse(f, log_r, multi_row=True)
    assert (lam1 <= 0.35 + 1e-7).all() and (lam1 >= 0).all()
    assert (lam2 <= 0.25 + 1e-7).all()


def test_soft_nms_brute_force(rng):
    sel = Selector(SelectorConfig(nms_radius=3, nms_strength=0.7, page_size=0))
    x = torch.randn(2, 25, generator=rng)
    got = sel.soft_nms(x)
    for h in range(2):
        for j in range(25):
            m = max(x[h, i].item() for i in range(max(0, j - 3), min(25, j + 4)))
            assert abs(got[h, j].item() - (x[h, j].item() - 0.7 * (m - x[h, j].item()))) < 1e-5
    # local peaks keep their score
    peaks = (got == x)
    assert peaks.any()


def test_exclusivity_brute_force_and_skip(rng):
    sel = Selector()
    x = torch.randn(4, 10, generator=rng)
    got = sel.exclusivity(x)
    for j in range(10):
        rho = torch.softmax(x[:, j] / 2.0, 0)
        assert torch.allclose(got[:, j], x[:, j] + 0.85 * torch.log(rho), atol=1e-5)
    two = torch.randn(2, 10, generator=rng)
    assert torch.equal(sel.exclusivity(two), two)


@pytest.mark.parametrize("use", [dict(), dict(use_prior=False), dict(use_nms=False), dict(use_exclusivity=False)])
def test_select_is_topk_of_scores(use, rng):
    sel = Selector(SelectorConfig(**use, page_size=0))
    p = _probs(4, 2, 400, rng)
    norms = torch.rand(4, 400 - 4 - 100, generator=rng) + 0.5
    pos = sel.select(p, norms, 4, 300, 32)
    assert pos.shape == (4, 32)
    assert (pos[:, 1:] > pos[:, :-1]).all() and pos.min() >= 4 and pos.max() < 300
    s = sel.scores(p, norms, 4, 300)
    for h in range(4):
        chosen = s[h, pos[h] - 4]
        rest = torch.ones(296, dtype=torch.bool)
        rest[pos[h] - 4] = False
        assert chosen.min() >= s[h, rest].max()


def test_select_all_when_budget_covers_candidates(rng):
    p = _probs(3, 3, 50, rng)
    pos = Selector().select(p, torch.ones(3, 30), 4, 34, 100)
    assert torch.equal(pos, torch.arange(4, 34).expand(3, 30))
    assert Selector().select(p, torch.ones(3, 0), 4, 4, 10).shape == (3, 0)


def test_selector_prefers_attended_tokens(rng):
    """With a flat prior the evidence decides: heavily attended positions are kept."""
    p = torch.full((3, 3, 500), 1e-4)
    hot = torch.tensor([50, 120, 333])
    p[:, :, hot] = 0.3
    p = p / p.sum(-1, keepdim=True)
    pos = Selector(SelectorConfig(page_size=0)).select(p, torch.ones(3, 400), 4, 404, 8)
    for h in range(3):
        assert set(hot.tolist()) <= set(pos[h].tolist())


@pytest.mark.parametrize("overrides", [
    {},
    {"use_prior": False},
    {"use_nms": False},
    {"use_exclusivity": False},
    {"alpha": 1.0, "use_prior": False, "use_nms": False, "use_exclusivity": False, "smooth_kernel": 7},
    {"page_size": 16},
    {"page_size": 8, "use_nms": False},
    {"page_size": 16, "use_nms": True, "follow_pages": 3, "follow_penalty": 0.5},
    {"page_size": 0, "use_nms": True, "follow_pages": 0},  # the paper's Selector
])
@pytest.mark.parametrize("hkv,group", [(8, 4), (3, 3), (2, 1)])
def test_batched_selector_matches_per_row_reference(rng, overrides, hkv, group):
    """The batched selector (the GPU slow step's) picks the same positions as the reference,
    row by row, for rows of different contexts and budgets in one frame."""
    from sfi_vllm.selector import select_batched

    sel = Selector(SelectorConfig(**overrides))
    lo = 4
    ctx = [300, 97, 211, 260]
    hi = [c - w for c, w in zip(ctx, (64, 40, 80, 3))]
    k = [50, 53, 12, 1]  # 53 = every candidate of row 1
    width = max(ctx)
    logits = torch.randn(len(ctx), hkv, group, width, generator=rng) * 3
    for b, c in enumerate(ctx):
        logits[b, ..., c:] = float("-inf")
    probs = torch.softmax(logits, -1)
    norms = torch.rand(len(ctx), hkv, width, generator=rng) * 4 + 0.2
    got = select_batched(sel, probs, norms, lo, hi, k)
    assert got.shape == (len(ctx), hkv, max(k))
    for b in range(len(ctx)):
        ref = sel.select(probs[b, ..., : ctx[b]], norms[b, :, lo:hi[b]], lo, hi[b], k[b])
        assert torch.equal(got[b, :, : k[b]], ref), b


def test_slow_step_selection_captures_a_shape_only_once_it_recurs():
    """A shape's CUDA graph is captured from its third use on; the use counts are bounded and
    counted per shape (a mixed workload must not capture every new shape it meets)."""
    from sfi_vllm.backends import selection

    sel = selection.SlowStepSelection()
    a, b = ("a",), ("b",)
    assert [sel.count_use(a) for _ in range(4)] == [False, False, True, True]
    assert sel.count_use(b) is False  # counted apart from a
    for i in range(selection.MAX_COUNTED_SHAPES):
        sel.count_use((i,))
    assert len(sel._uses) == selection.MAX_COUNTED_SHAPES
    assert a not in sel._uses  # the oldest shapes are forgotten
    assert sel.count_use(a) is False
    assert selection.SlowStepSelection(capture_after=1).count_use(a) is True


def test_slow_step_selection_counts_the_layers_of_one_step_once():
    """Every layer of a slow step calls the selection with the same shape: that is one use, so a
    shape seen in a single step (30 layers) is not captured; an evicted shape counts afresh."""
    from sfi_vllm.backends import selection

    sel = selection.SlowStepSelection()
    a = ("a",)
    assert not any(sel.count_use(a, step=7) for _ in range(30))
    assert not sel.count_use(a, step=8)
    assert sel.count_use(a, step=9)
    sel.forget(a)
    assert not sel.count_use(a, step=10)


def test_fast_step_split_counts_are_powers_of_two():
    """The split count is a compile-time constant of the fast-step kernels: a draining batch must
    not meet a new one at every step (each a compilation)."""
    pytest.importorskip("triton")
    from sfi_vllm.kernels.fast_decode import default_num_splits

    seen = {default_num_splits(rows, hkv, keys) for rows in range(1, 64) for hkv in (1, 3, 8)
            for keys in range(1, 20000, 97)}
    assert seen <= {1, 2, 4, 8, 16, 32, 64} and {1, 64} <= seen


def test_page_selection_keeps_a_run_of_tokens_that_token_soft_nms_thins():
    """A needle written over 10 adjacent tokens, its evidence peaked on the first: token-level
    soft-NMS keeps the peak and pushes the neighbours below the background; page selection (16)
    keeps the needle's page whole, then takes the best tokens of the next page by mass."""
    n, lo = 400, 4
    probs = torch.full((3, 3, n + lo), 1e-4)
    needle = torch.arange(194, 204)  # candidate indices, inside page 12 (j = 192..207)
    probs[:, :, lo + needle] = 0.001
    probs[:, :, lo + 194] = 0.02
    probs[:, :, lo + 300] = 0.01  # a single-token peak in page 18 (j = 288..303)
    norms = torch.ones(3, n)
    token = Selector(SelectorConfig(use_prior=False, use_exclusivity=False, page_size=0, use_nms=True))
    paged = Selector(SelectorConfig(use_prior=False, use_exclusivity=False, page_size=16, use_nms=True,
                                    follow_pages=0))
    k = 20
    needle_abs = set((lo + needle).tolist())
    tok_sel = set(token.select(probs, norms, lo, lo + n, k)[0].tolist())
    assert lo + 194 in tok_sel and len(needle_abs & tok_sel) < 5  # soft-NMS thins the run
    page_sel = paged.select(probs, norms, lo, lo + n, k)[0].tolist()
    assert len(page_sel) == k
    assert set(range(lo + 192, lo + 208)) <= set(page_sel)  # the needle's page, whole
    assert lo + 300 in page_sel  # then the next page's best token first


def test_page_mass_ignores_positions_past_the_candidates():
    from sfi_vllm.selector import page_mass

    x = torch.tensor([[0.0, 0.0, float("-inf"), float("-inf"), float("-inf")]])
    got = page_mass(x, 2)
    assert got.shape == (1, 3)
    assert torch.allclose(got[0, 0], torch.log(torch.tensor(2.0)))
    assert got[0, 1] == float("-inf") and got[0, 2] == float("-inf")


def test_follow_spread_brute_force():
    """Each page takes the best of its own score and its ``follow_pages`` predecessors' less the
    penalty per page; pages past the candidates stay -inf."""
    from sfi_vllm.selector import follow_spread

    inf = float("-inf")
    x = torch.tensor([[-1.0, -9.0, -9.0, -3.0, -9.0, -9.0, -9.0, inf, inf]])
    got = follow_spread(x, SelectorConfig(follow_pages=2, follow_penalty=0.5))
    want = [-1.0, -1.5, -2.0, -3.0, -3.5, -4.0, -9.0, inf, inf]
    assert got[0].tolist() == want
    assert torch.equal(follow_spread(x, SelectorConfig(follow_pages=0)), x)


def test_followed_pages_keep_the_rest_of_a_number_that_straddles_a_page_boundary():
    """A query that reads a number's first digits (its evidence on page 12, the number running
    on into page 13): with follow_pages the next page is selected too, without it a stronger
    unrelated page wins the second slot."""
    n, lo = 400, 4
    probs = torch.full((3, 3, n + lo), 1e-4)
    probs[:, :, lo + 204:lo + 208] = 0.01  # the end of page 12 (j = 192..207)
    probs[:, :, lo + 320] = 0.004  # an unrelated peak on page 20
    norms = torch.ones(3, n)
    base = dict(use_prior=False, use_exclusivity=False, page_size=16)
    plain = set(Selector(SelectorConfig(**base, follow_pages=0)).select(probs, norms, lo, lo + n, 32)[0].tolist())
    follow = set(Selector(SelectorConfig(**base, follow_pages=1)).select(probs, norms, lo, lo + n, 32)[0].tolist())
    page13 = set(range(lo + 208, lo + 224))
    assert set(range(lo + 192, lo + 208)) <= plain and not page13 & plain and lo + 320 in plain
    assert set(range(lo + 192, lo + 208)) <= follow and page13 <= follow


def _page_first_brute_force(pages, tokens, page, k):
    """Page selection's top-K, one head, by hand: pages in descending score (ties to the lower
    index), each page's candidates in descending log s (ties to the lower position), the first k."""
    order = sorted(range(len(pages)), key=lambda p: (-pages[p], p))
    picked = []
    for p in order:
        toks = [j for j in range(p * page, min((p + 1) * page, len(tokens))) if tokens[j] > float("-inf")]
        picked += sorted(toks, key=lambda j: (-tokens[j], j))
    return sorted(picked[:k])


@pytest.mark.parametrize("page,width,n", [(16, 300, 300), (16, 300, 261), (8, 100, 37), (4, 10, 10)])
def test_top_k_pages_takes_whole_pages_best_first(rng, page, width, n):
    """top_k_pages against a brute force for every budget up to the candidates, with rows of
    different budgets in one batch, a last page that holds fewer than ``page`` candidates, and
    in-page ties (tokens at the log s floor)."""
    from sfi_vllm.selector import PageScores, top_k_pages

    hkv, lo = 3, 4
    units = -(-width // page)
    pages = torch.randn(1, hkv, units, generator=rng)
    pages[..., units - 1] += 3.0  # the short last page among the best
    tokens = torch.randn(1, hkv, width, generator=rng)
    tokens[..., ::5] = -80.0  # ties inside pages
    tokens[..., n - 1] = 5.0  # the best token of the last page: a frame that is no whole number of pages
    tokens[..., n:] = float("-inf")
    pages[..., -(-n // page):] = float("-inf")  # pages past the candidates
    for kmax in sorted({1, page - 1, page, page + 1, n // 2, n - 1, n}):
        ks = [kmax, max(1, kmax // 3), 1]
        batch = PageScores(pages.expand(3, -1, -1), tokens.expand(3, -1, -1), page)
        got = top_k_pages(batch, lo, torch.tensor(ks), kmax)
        assert got.shape == (3, hkv, kmax)
        for b, k in enumerate(ks):
            for h in range(hkv):
                want = _page_first_brute_force(pages[0, h].tolist(), tokens[0, h].tolist(), page, k)
                assert got[b, h, :k].tolist() == [lo + j for j in want], (kmax, b, h)
                assert (got[b, h, k:] == lo + width).all()


def test_page_select_matches_batched():
    """Selector.select (one row) and the batched page selection agree (the reference path and the
    kernel path share top_k_pages)."""
    from sfi_vllm.selector import select_batched

    gen = torch.Generator().manual_seed(3)
    sel = Selector(SelectorConfig(page_size=16))
    lo, ctx = 4, [500, 333]
    hi = [c - 40 for c in ctx]
    probs = torch.softmax(torch.randn(2, 4, 2, max(ctx), generator=gen) * 3, -1)
    norms = torch.rand(2, 4, max(ctx), generator=gen) + 0.3
    got = select_batched(sel, probs, norms, lo, hi, [100, 37])
    for b, k in enumerate((100, 37)):
        ref = sel.select(probs[b], norms[b, :, lo:hi[b]], lo, hi[b], k)
        assert torch.equal(got[b, :, :k], ref)


@pytest.mark.parametrize("page", [1, 4, 16])
def test_quest_page_bounds_bound_every_keys_logit_and_meet_it_on_one_token_pages(rng, page):
    hkv, g, d, n, lo = 3, 3, 8, 70, 5
    q = torch.randn(hkv * g, d, generator=rng)
    keys = torch.randn(hkv, n, d, generator=rng)
    bounds = quest_page_bounds(q, keys, lo, n, page, 0.5)
    assert bounds.shape == (hkv, -(-(n - lo) // page))
    logits = 0.5 * torch.einsum("hgd,hnd->hgn", q.view(hkv, g, d), keys)[..., lo:]  # (Hkv, G, n - lo)
    pad = bounds.shape[1] * page - (n - lo)
    per_page = torch.nn.functional.pad(logits, (0, pad), value=float("-inf")).view(hkv, g, -1, page).amax(-1)
    best = per_page.amax(1)  # the page's largest logit over the group's query heads
    assert (bounds >= best - 1e-5).all()
    if page == 1:
        assert torch.allclose(bounds, best, atol=1e-5)
    else:
        assert (bounds > best + 1e-3).any()  # min/max per dimension: an upper bound, loose in general


def test_candidate_page_mask_takes_the_highest_bounds_spread_over_the_pages_they_lead():
    cfg = SelectorConfig(page_size=16, follow_pages=2, follow_penalty=1.0)
    bounds = torch.zeros(2, 40)
    bounds[0, 7] = 10.0  # the page after it (8) and the one after that (9) take 9 and 8
    bounds[0, 30] = 8.5
    bounds[1, 39] = 5.0  # the last page: nothing after it
    mask = candidate_page_mask(bounds, 30, 1.5, cfg)  # ceil(30 / 16) = 2 pages, x 1.5 -> 3
    assert mask.sum(1).tolist() == [3, 3]
    assert mask[0].nonzero().flatten().tolist() == [7, 8, 30]
    assert mask[1, 39]
    # at least one page more than the budget needs, and every page when there are fewer
    assert candidate_page_mask(bounds, 32, 1.0, cfg).sum(1).tolist() == [3, 3]
    assert candidate_page_mask(bounds[:, :2], 32, 4.0, cfg).all()


def test_selection_from_candidate_pages_takes_only_them_and_all_of_them_changes_nothing(rng):
    cfg = SelectorConfig(page_size=8)
    sel = Selector(cfg)
    hkv, lo, hi, k = 3, 4, 204, 40
    probs = _probs(hkv, 4, 230, rng)
    norms = torch.rand(hkv, hi - lo, generator=rng) + 0.5
    pages = -(-(hi - lo) // 8)
    full = sel.select(probs, norms, lo, hi, k)
    assert torch.equal(sel.select(probs, norms, lo, hi, k, candidates=torch.ones(hkv, pages, dtype=torch.bool)), full)
    mask = torch.zeros(hkv, pages, dtype=torch.bool)
    mask[:, ::3] = True  # 9 pages of 8 per head: room for k = 40
    got = sel.select(probs, norms, lo, hi, k, candidates=mask)
    assert got.shape == (hkv, k) and (got < hi).all()
    assert all(bool(mask[h, (got[h] - lo) // 8].all()) for h in range(hkv))
    with pytest.raises(ValueError, match="page selection"):
        Selector(SelectorConfig(page_size=1)).select(probs, norms, lo, hi, k, candidates=mask)
    few = torch.zeros(hkv, pages, dtype=torch.bool)
    few[:, :4] = True  # 32 tokens per head, fewer than k
    with pytest.raises(ValueError, match="fewer than the 40 tokens"):
        sel.select(probs, norms, lo, hi, k, candidates=few)


def test_candidate_pages_need_page_selection():
    from sfi_vllm.config import SFIConfigError, build_config

    with pytest.raises(SFIConfigError, match=r"candidate_pages \(an engine setting\) needs page selection"):
        build_config({"experimental": {"candidate_pages": 8}, "selector": {"page_size": 1}}, use_env=False)


def test_candidate_scores_are_the_fusion_over_the_candidates_alone(rng):
    """With candidates, each kept token's fused score is what the Selector computes from the
    candidates' evidence and prior alone (both normalised over them); the others score the floor."""
    from sfi_vllm.selector import _LOG_FLOOR, _log_normalize

    cfg = SelectorConfig(page_size=8, use_exclusivity=False)
    sel = Selector(cfg)
    hkv, lo, hi = 3, 4, 204
    probs = _probs(hkv, 4, 230, rng)
    norms = torch.rand(hkv, hi - lo, generator=rng) + 0.5
    pages = -(-(hi - lo) // 8)
    mask = torch.zeros(hkv, pages, dtype=torch.bool)
    mask[:, ::3] = True
    kept = mask.repeat_interleave(8, dim=1)[:, : hi - lo]
    cols = kept[0].nonzero().flatten()
    restricted = probs.clone()
    restricted[..., lo:hi] *= kept[:, None, :]
    got = sel.scores(restricted, norms, lo, hi, kept=kept).tokens
    f_c = sel.evidence(probs[..., lo:hi][..., cols], 0, len(cols))
    log_r_c = _log_normalize(sel.log_prior(norms)[:, cols])
    want, _ = sel.fuse(f_c, log_r_c, multi_row=True)
    assert torch.allclose(got[:, cols], want, atol=1e-5)
    assert (got[~kept] == _LOG_FLOOR).all()
