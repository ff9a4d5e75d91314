"""The Selector: turn a slow step's attention scores over the whole history into the next fast
steps' selected tokens.

Per layer and sequence, over candidate positions ``j in [lo, hi)`` (after the sinks, before the
recent window), for each KV head:

1. evidence ``f``: the attention probabilities of the GQA group's query rows, pooled by a power
   mean (alpha = 0.5) and renormalised over the candidates;
2. prior ``r`` from key norms and relative position ``u = (j - lo) / (hi - lo - 1)``:
   ``log r = w_n * (-gamma * log|k|) + w_p * (-beta * u**p + eta * log(1 - u))``, renormalised;
3. closed-form fusion ``s = (1 - lam) f + lam r`` with the adaptive
   ``lam* = <f, f - r> / |f - r|^2`` clipped to ``[0, lambda_max]``;
4. soft non-maximum suppression: ``log s' = log s - a * (max_{|i-j|<=R} log s_i - log s)``;
5. cross-head exclusivity (more than 2 KV heads): ``rho = softmax_h(log s' / T)``,
   ``log s'' = log s' + c * log rho``;
6. top-K of ``log s''`` per head.

``page_size > 1`` (ours, not the paper's) ranks whole pages of candidates instead of tokens: after
the fusion, each page's score is its fused mass (log-sum-exp of ``log s`` over the page), soft-NMS
(radius ``ceil(nms_radius / page_size)`` pages) and exclusivity act on page scores
(:class:`PageScores`), and top-K takes pages whole, best page first, until the budget is reached;
the last, partly taken page keeps its best tokens by ``log s`` (:func:`top_k_pages`). A multi-token
unit (a number written a digit per token) then stays together instead of soft-NMS keeping only its
peak token. The top-K runs over pages, a sixteenth of the tokens at the default page size.

This module is the plain-torch spec; GPU kernels must match it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from sfi_vllm.config import SelectorConfig

_LOG_FLOOR = -80.0  # log-probabilities are clamped here so that differences stay finite
_EPS = 1e-30


class PageScores(NamedTuple):
    """Steps 1-5 of page selection: ``pages (..., P)``, the final score of each page of
    ``page`` candidates (``-inf`` for a page past the row's candidates), and ``tokens (..., W)``,
    each candidate's fused ``log s`` (``-inf`` past the row's candidates), which orders the tokens
    of the page that top-K takes only in part."""
    pages: torch.Tensor
    tokens: torch.Tensor
    page: int


def page_mass(log_s: torch.Tensor, page: int) -> torch.Tensor:
    """``log s (..., C)`` -> ``(..., ceil(C / page))``: log of each page's total mass (-inf entries,
    candidates past a row's end, add nothing; a page of only -inf is -inf)."""
    pad = (-log_s.shape[-1]) % page
    x = F.pad(log_s, (0, pad), value=float("-inf"))
    return torch.logsumexp(x.unflatten(-1, (-1, page)), dim=-1)


def follow_spread(page_scores: torch.Tensor, cfg: SelectorConfig) -> torch.Tensor:
    """``follow_pages`` (page mode): each page also takes the score of each of the
    ``follow_pages`` pages before it, less ``follow_penalty`` per page of distance (the max of
    those and its own). Text that a query reads is usually read on from there (a number written a
    digit per token, a passage being copied): the pages after a strong page join the set with it.
    ``-inf`` entries (past a row's candidates) stay ``-inf``."""
    reach = cfg.follow_pages
    if reach <= 0 or page_scores.shape[-1] <= 1:
        return page_scores
    out = page_scores
    for d in range(1, min(reach, page_scores.shape[-1] - 1) + 1):
        shifted = F.pad(page_scores[..., :-d], (d, 0), value=float("-inf")) - d * cfg.follow_penalty
        out = torch.maximum(out, shifted)
    return torch.where(torch.isneginf(page_scores), page_scores, out)


def quest_page_bounds(q: torch.Tensor, keys: torch.Tensor, lo: int, hi: int, page: int,
                      scale: float) -> torch.Tensor:
    """Quest's upper bound of each page's attention logit: ``q (Hq, D)`` the slow step's query,
    ``keys (Hkv, L, D)`` -> ``(Hkv, ceil((hi - lo) / page))``, per page of candidates ``[lo, hi)``
    (pages counted from ``lo``, as the Selector's) the max over the KV head's query heads of
    ``scale * sum_d max(q_d * kmin_d, q_d * kmax_d)``, from the page's per-dimension key min/max.
    No key of the page has a larger logit for that query."""
    hkv, _, d = keys.shape
    n = hi - lo
    pages = -(-n // page)
    pad = pages * page - n
    k = F.pad(keys[:, lo:hi].float(), (0, 0, 0, pad)).view(hkv, pages, page, d)
    real = (torch.arange(pages * page, device=keys.device) < n).view(1, pages, page, 1)
    kmin = torch.where(real, k, float("inf")).amin(2)
    kmax = torch.where(real, k, float("-inf")).amax(2)  # (Hkv, P, D)
    qg = q.float().view(hkv, -1, 1, d)  # (Hkv, G, 1, D)
    return scale * torch.maximum(qg * kmin[:, None], qg * kmax[:, None]).sum(-1).amax(1)


def candidate_page_mask(bounds: torch.Tensor, k: int, multiple: float, cfg: SelectorConfig) -> torch.Tensor:
    """``bounds (Hkv, P)`` (:func:`quest_page_bounds`) -> ``(Hkv, P)`` bool: per KV head the
    ``max(ceil(multiple x ceil(k / page)), ceil(k / page) + 1)`` pages (all, if fewer) of highest bound,
    each page's bound first spread over the pages after it as :func:`follow_spread` spreads page
    scores, so that the pages the Selector would take for following a strong page are candidates
    with it. The extra page keeps ``k`` tokens within the candidates when one of them is the last,
    partial page."""
    hkv, pages = bounds.shape
    need = -(-k // cfg.page_size)
    m = min(pages, max(math.ceil(multiple * need - 1e-9), need + 1))
    top = torch.topk(follow_spread(bounds, cfg), m, dim=-1).indices
    return torch.zeros(hkv, pages, dtype=torch.bool, device=bounds.device).scatter_(1, top, True)


def page_radius(cfg: SelectorConfig) -> int:
    """Soft-NMS radius in pages (page mode) or tokens."""
    return -(-cfg.nms_radius // cfg.page_size) if cfg.page_size > 1 else cfg.nms_radius


def _log_normalize(logits: torch.Tensor) -> torch.Tensor:
    return logits - torch.logsumexp(logits, dim=-1, keepdim=True)


class Selector:
    def __init__(self, cfg: SelectorConfig | None = None) -> None:
        self.cfg = cfg or SelectorConfig()

    # 1. evidence --------------------------------------------------------------------------------
    def evidence(self, probs: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """``probs (Hkv, R, L)`` -> ``f (Hkv, hi - lo)``, each row summing to 1."""
        a = self.cfg.alpha
        p = probs[..., lo:hi].float().clamp_min(0.0)
        p = p / p.sum(dim=-1, keepdim=True).clamp_min(_EPS)  # each query row over the candidates
        pooled = p.pow(a).mean(dim=1).pow(1.0 / a)
        total = pooled.sum(dim=-1, keepdim=True)
        uniform = torch.full_like(pooled, 1.0 / max(hi - lo, 1))
        return torch.where(total > 0, pooled / total.clamp_min(_EPS), uniform)

    # 2. prior -----------------------------------------------------------------------------------
    def log_prior(self, key_norms: torch.Tensor) -> torch.Tensor:
        """``key_norms (Hkv, C)`` of the candidates -> ``log r (Hkv, C)``, normalised."""
        c = self.cfg
        n = key_norms.shape[-1]
        if n == 1:
            u = torch.zeros(1, device=key_norms.device)
            rest = torch.ones(1, device=key_norms.device)
        else:
            j = torch.arange(n, device=key_norms.device, dtype=torch.float32)
            u = j / (n - 1)
            rest = (n - 1 - j) / (n - 1)  # 1 - u without cancellation: exactly 0 at the last candidate
        pos = -c.beta * u.pow(c.pos_power) + c.eta * torch.log(rest.clamp_min(_EPS))
        norm = -c.gamma * torch.log(key_norms.float().clamp_min(_EPS))
        return _log_normalize(c.w_norm * norm + c.w_pos * pos)

    # 3. fusion ----------------------------------------------------------------------------------
    def fuse(
        self, f: torch.Tensor, log_r: torch.Tensor, multi_row: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> ``(log s (Hkv, C), lam (Hkv,))``."""
        r = log_r.exp()
        diff = f - r
        denom = (diff * diff).sum(dim=-1)
        lam = torch.where(denom > 0, (f * diff).sum(dim=-1) / denom.clamp_min(_EPS), torch.zeros_like(denom))
        lam_max = self.cfg.lambda_max_multi if multi_row else self.cfg.lambda_max_single
        lam = lam.clamp(0.0, lam_max)
        log_f = torch.log(f.clamp_min(_EPS))
        lam_ = lam[:, None]
        log_s = torch.logaddexp(
            torch.log((1.0 - lam_).clamp_min(_EPS)) + log_f,
            torch.log(lam_.clamp_min(_EPS)) + log_r,
        )
        # lam == 0 exactly means s = f (log(eps) + log r would leak a negligible amount otherwise)
        log_s = torch.where(lam_ > 0, log_s, log_f)
        return log_s.clamp_min(_LOG_FLOOR), lam

    # 4. soft-NMS --------------------------------------------------------------------------------
    def soft_nms(self, log_s: torch.Tensor) -> torch.Tensor:
        r = page_radius(self.cfg)
        local_max = F.max_pool1d(log_s[:, None, :], kernel_size=2 * r + 1, stride=1, padding=r)[:, 0]
        return log_s - self.cfg.nms_strength * (local_max - log_s)

    # 5. exclusivity -----------------------------------------------------------------------------
    def exclusivity(self, log_s: torch.Tensor) -> torch.Tensor:
        if log_s.shape[0] <= 2:
            return log_s
        t, c = self.cfg.exclusivity_temperature, self.cfg.exclusivity_strength
        log_rho = torch.log_softmax(log_s / t, dim=0)
        return log_s + c * log_rho

    # all steps ----------------------------------------------------------------------------------
    def scores(
        self, probs: torch.Tensor, key_norms: torch.Tensor, lo: int, hi: int, num_query_rows: int = 1,
        kept: torch.Tensor | None = None,
    ) -> torch.Tensor | PageScores:
        """Final per-candidate scores ``(Hkv, hi - lo)``, higher kept first; in page mode the
        :class:`PageScores` that :func:`top_k_pages` ranks. ``kept (Hkv, hi - lo)``: only those
        candidates are scored: the evidence and the prior are normalised over them, and the other
        tokens score the floor."""
        f = self.evidence(probs, lo, hi)
        if self.cfg.smooth_kernel > 1:
            k = self.cfg.smooth_kernel
            f = F.avg_pool1d(f[:, None, :], kernel_size=k, stride=1, padding=k // 2,
                             count_include_pad=False)[:, 0, : f.shape[-1]]
        if kept is not None:  # the evidence on the scored candidates only (uniform over them if none)
            f = torch.where(kept, f, 0.0)
            total = f.sum(dim=-1, keepdim=True)
            uniform = kept / kept.sum(dim=-1, keepdim=True).clamp_min(1)
            f = torch.where(total > 0, f / total.clamp_min(_EPS), uniform)
        if self.cfg.use_prior:
            log_r = self.log_prior(key_norms)
            if kept is not None:  # the norms and positions of the scored candidates only
                log_r = _log_normalize(torch.where(kept, log_r, float("-inf")))
            log_s, _ = self.fuse(f, log_r, multi_row=probs.shape[1] * num_query_rows > 1)
        else:
            log_s = torch.log(f.clamp_min(_EPS)).clamp_min(_LOG_FLOOR)
        if kept is not None:
            log_s = torch.where(kept, log_s, _LOG_FLOOR)
        page = self.cfg.page_size
        token_log_s = log_s
        if page > 1:
            log_s = follow_spread(page_mass(log_s, page), self.cfg)
        if self.cfg.use_nms:
            log_s = self.soft_nms(log_s)
        if self.cfg.use_exclusivity:
            log_s = self.exclusivity(log_s)
        if page > 1:
            return PageScores(log_s, token_log_s, page)
        return log_s

    def select(
        self,
        probs: torch.Tensor,
        key_norms: torch.Tensor,
        lo: int,
        hi: int,
        k: int,
        num_query_rows: int = 1,
        candidates: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Absolute positions ``(Hkv, min(k, hi - lo))``, ascending per head.

        ``probs (Hkv, R, L)`` are the slow step's attention probabilities over the whole history
        (``R`` = query heads of the group x captured query rows); ``key_norms (Hkv, hi - lo)``.
        ``candidates (Hkv, P)`` (page mode, :func:`candidate_page_mask`): only those pages are
        scored, as a re-selection that read only their keys would: the evidence is the attention
        on their tokens, the prior is normalised over them (their key norms and positions), the
        other pages' tokens score the floor (``follow_pages`` still spreads a candidate page's
        score onto the pages after it) and those pages cannot be taken. They must hold at least
        ``k`` tokens per head.
        """
        hkv = probs.shape[0]
        n = hi - lo
        k = max(0, min(k, n))
        if k == 0:
            return torch.empty(hkv, 0, dtype=torch.long, device=probs.device)
        if k == n:
            return torch.arange(lo, hi, device=probs.device).expand(hkv, n).clone()
        tokens_kept = None
        if candidates is not None:
            if self.cfg.page_size <= 1:
                raise ValueError("candidate pages need page selection (selector.page_size > 1)")
            tokens_kept = candidates.repeat_interleave(self.cfg.page_size, dim=1)[:, :n]
            if bool((tokens_kept.sum(1) < k).any()):
                raise ValueError(f"the candidate pages hold fewer than the {k} tokens to select")
            probs = probs.clone()
            probs[..., lo:hi] *= tokens_kept[:, None, :]
        s = self.scores(probs, key_norms, lo, hi, num_query_rows, kept=tokens_kept)
        if tokens_kept is not None:
            assert isinstance(s, PageScores) and candidates is not None
            s = PageScores(torch.where(candidates, s.pages, float("-inf")),
                           torch.where(tokens_kept, s.tokens, float("-inf")), s.page)
        if isinstance(s, PageScores):
            budget = torch.tensor([k], dtype=torch.long, device=probs.device)
            return top_k_pages(PageScores(s.pages[None], s.tokens[None], s.page), lo, budget, k)[0]
        idx = torch.topk(s, k, dim=-1).indices
        return torch.sort(idx, dim=-1).values + lo


def select_batched(selector: Selector, probs: torch.Tensor, key_norms: torch.Tensor, lo: int,
                   hi: list[int], k: list[int], num_query_rows: int = 1) -> torch.Tensor:
    """:meth:`Selector.select` for a batch of rows with different candidate ranges, as tensor ops
    with no host synchronisation (the GPU slow step runs this for all its rows at once).

    ``probs (B, Hkv, R, W)`` and ``key_norms (B, Hkv, W)`` cover positions ``[0, W)``; row ``b``'s
    candidates are ``[lo, hi[b])`` and it keeps ``k[b]`` of them. Returns ``(B, Hkv, max(k))``
    positions; row ``b``'s first ``k[b]`` per head are its selection, ascending (the rest are
    padding). Every row must have ``0 < k[b] <= hi[b] - lo``. Row ``b`` equals
    ``selector.select(probs[b], key_norms[b, :, lo:hi[b]], lo, hi[b], k[b])`` up to ties.
    """
    assert min(k) > 0 and all(kk <= h - lo for kk, h in zip(k, hi))
    dev = probs.device
    n = torch.tensor([h - lo for h in hi], dtype=torch.float32).to(dev, non_blocking=True)
    kt = torch.tensor(k, dtype=torch.long).to(dev, non_blocking=True)
    width = max(hi)
    return select_batched_static(selector, probs[..., :width], key_norms[..., :width], lo, n, kt, max(k),
                                 num_query_rows)


def select_batched_static(selector: Selector, probs: torch.Tensor, key_norms: torch.Tensor, lo: int,
                          n: torch.Tensor, k: torch.Tensor, kmax: int, num_query_rows: int = 1) -> torch.Tensor:
    """:func:`select_batched` with fixed shapes (capturable in a CUDA graph): the candidates of
    row ``b`` are ``[lo, lo + n[b])`` (``n`` float32 on the device), it keeps ``k[b] <= kmax``
    (int64 on the device); positions past a row's candidates in the ``W``-wide frame are ignored."""
    scores = batched_scores_static(selector, probs, key_norms, lo, n, num_query_rows)
    return top_k_positions(scores, lo, k, kmax)


def top_k_positions(scores: torch.Tensor | PageScores, lo: int, k: torch.Tensor, kmax: int) -> torch.Tensor:
    """Step 6 for a batch: ``scores (B, Hkv, W)`` over candidates ``lo + j`` -> ``(B, Hkv, kmax)``
    absolute positions, row ``b``'s best ``k[b]`` per head ascending, then padding past the frame
    (``lo + W``). :class:`PageScores` go to :func:`top_k_pages`."""
    if isinstance(scores, PageScores):
        return top_k_pages(scores, lo, k, kmax)
    width = scores.shape[-1]
    idx = torch.topk(scores, kmax, dim=-1).indices
    keep = torch.arange(kmax, device=scores.device)[None, None, :] < k[:, None, None]
    idx = torch.where(keep, idx, torch.full_like(idx, width))
    return torch.sort(idx, dim=-1).values + lo


def top_k_pages(scores: PageScores, lo: int, k: torch.Tensor, kmax: int, stable: bool = False) -> torch.Tensor:
    """Step 6 of page selection, as :func:`top_k_positions` returns it: per row and head, pages are
    taken whole in descending page score until ``k[b]`` tokens are taken; of the page that would pass
    the budget, its best tokens by ``log s`` (ties to the lower position). Only one page of a row
    holds fewer than ``page`` candidates (its last), so the ``ceil(kmax / page) + 1`` best pages
    always hold the budget: top-K runs over those pages and never over the tokens, and only the one
    page taken in part is ranked inside. Ties between equal page scores are taken in any order (as
    torch.topk's); ``stable``: to the lower page (a stable sort; the rule of the Triton kernel,
    ``sfi_vllm.kernels.top_k_pages``)."""
    pages, tokens, g = scores
    B, hkv, units = pages.shape
    width = tokens.shape[-1]
    dev = pages.device
    kp = min(units, -(-kmax // g) + 1)
    if stable:
        top = torch.sort(pages, dim=-1, descending=True, stable=True).indices[..., :kp]
    else:
        top = torch.topk(pages, kp, dim=-1).indices  # (B, Hkv, kp), best page first
    off = torch.arange(g, device=dev)
    pos = top[..., None] * g + off  # (B, Hkv, kp, g) candidate indices
    tok = torch.gather(tokens, -1, pos.clamp_max(width - 1).flatten(2)).view(B, hkv, kp, g)
    tok = torch.where(pos < width, tok, float("-inf"))
    valid = tok > float("-inf")  # a candidate of its row (log s >= the floor)
    counts = valid.sum(-1)  # (B, Hkv, kp)
    before = torch.cumsum(counts, -1) - counts  # tokens taken from the better pages
    take = (k[:, None, None] - before).clamp(min=0)  # of this page: its best `take` tokens
    taken = valid & (take >= counts)[..., None]  # the pages taken whole
    # the page taken in part (at most one per row and head): its tokens ranked by log s
    partial = (take > 0) & (take < counts)
    has = partial.any(-1)
    at = partial.to(torch.int8).argmax(-1)[..., None, None].expand(B, hkv, 1, g)
    ptok = torch.gather(tok, 2, at)[:, :, 0]  # (B, Hkv, g)
    ahead = (ptok[..., None, :] > ptok[..., :, None]) | (
        (ptok[..., None, :] == ptok[..., :, None]) & (off[None, :] < off[:, None]))
    rank = ahead.sum(-1)  # [i]: tokens of the page before token i in the order
    ptake = torch.gather(take, 2, at[..., 0])  # (B, Hkv, 1)
    part = torch.gather(valid, 2, at)[:, :, 0] & (rank < ptake)
    taken.scatter_(2, at, torch.where(has[..., None, None], part[:, :, None], torch.gather(taken, 2, at)))
    # ascending positions: the pages in index order, then the taken tokens packed to the front
    top, order = torch.sort(top, dim=-1)
    taken = torch.gather(taken, 2, order[..., None].expand(B, hkv, kp, g)).flatten(2)
    pos = (top[..., None] * g + off).flatten(2)
    slot = torch.where(taken, torch.cumsum(taken, -1) - 1, kmax)  # untaken: a column dropped below
    out = torch.full((B, hkv, kmax + 1), width, dtype=pos.dtype, device=dev)
    out.scatter_(-1, slot, pos)
    return out[..., :kmax] + lo


def batched_scores_static(selector: Selector, probs: torch.Tensor, key_norms: torch.Tensor, lo: int,
                          n: torch.Tensor, num_query_rows: int = 1) -> torch.Tensor | PageScores:
    """Steps 1-5 for a batch: final scores ``(B, Hkv, W - lo)`` of candidates ``lo + j``; ``-inf``
    past row ``b``'s ``n[b]`` candidates (page mode: :class:`PageScores` over them). The spec of
    ``sfi_vllm.kernels.selector_scores``."""
    c = selector.cfg
    B, hkv = probs.shape[:2]
    dev = probs.device
    width = probs.shape[-1] - lo
    n = n[:, None, None]
    j = torch.arange(width, device=dev, dtype=torch.float32)
    valid = j < n  # (B, 1, W)
    neg_inf = float("-inf")

    # 1. evidence: power mean over the group's rows, renormalised over each row's candidates
    p = probs[..., lo:].float().clamp_min(0.0) * valid[:, :, None, :]
    p = p / p.sum(dim=-1, keepdim=True).clamp_min(_EPS)  # each query row over its candidates
    pooled = p.pow(c.alpha).mean(dim=2).pow(1.0 / c.alpha) * valid
    total = pooled.sum(dim=-1, keepdim=True)
    f = torch.where(total > 0, pooled / total.clamp_min(_EPS), valid / n)
    if c.smooth_kernel > 1:
        kk = c.smooth_kernel
        flat = f.reshape(B * hkv, 1, width)
        ones = valid.expand(B, hkv, width).reshape(B * hkv, 1, width).float()
        s_sum = F.avg_pool1d(flat, kk, 1, kk // 2, count_include_pad=True)[..., :width]
        s_cnt = F.avg_pool1d(ones, kk, 1, kk // 2, count_include_pad=True)[..., :width]
        f = (s_sum / s_cnt.clamp_min(_EPS)).view(B, hkv, width) * valid

    # 2-3. prior and closed-form fusion
    if c.use_prior:
        u = j / (n - 1).clamp_min(1.0)
        rest = torch.where(n > 1, (n - 1 - j) / (n - 1).clamp_min(1.0), 1.0)  # 1 - u, as in log_prior
        pos = -c.beta * u.pow(c.pos_power) + c.eta * torch.log(rest.clamp_min(_EPS))
        norm = -c.gamma * torch.log(key_norms[..., lo:].float().clamp_min(_EPS))
        log_r = torch.where(valid, c.w_norm * norm + c.w_pos * pos, neg_inf)
        log_r = log_r - torch.logsumexp(log_r, dim=-1, keepdim=True)
        r = log_r.exp()
        diff = f - r
        denom = (diff * diff).sum(dim=-1)
        lam = torch.where(denom > 0, (f * diff).sum(dim=-1) / denom.clamp_min(_EPS), torch.zeros_like(denom))
        multi = probs.shape[2] * num_query_rows > 1  # query rows of the GQA group x captured rows
        lam = lam.clamp(0.0, c.lambda_max_multi if multi else c.lambda_max_single)[..., None]
        log_f = torch.log(f.clamp_min(_EPS))
        log_s = torch.logaddexp(torch.log((1.0 - lam).clamp_min(_EPS)) + log_f,
                                torch.log(lam.clamp_min(_EPS)) + torch.where(valid, log_r, 0.0))
        log_s = torch.where(lam > 0, log_s, log_f).clamp_min(_LOG_FLOOR)
    else:
        log_s = torch.log(f.clamp_min(_EPS)).clamp_min(_LOG_FLOOR)
    log_s = torch.where(valid, log_s, neg_inf)
    token_log_s = log_s
    if c.page_size > 1:  # pages of candidates: the units that steps 4-5 and top-K rank
        log_s = follow_spread(page_mass(log_s, c.page_size), c)
        units = log_s.shape[-1]
        valid = torch.arange(units, device=dev, dtype=torch.float32) * c.page_size < n
    else:
        units = width

    # 4. soft-NMS (positions past a row's candidates are -inf, as max_pool1d's padding is)
    if c.use_nms:
        r_ = page_radius(c)
        local_max = F.max_pool1d(log_s.reshape(B * hkv, 1, units), 2 * r_ + 1, 1, r_).view(B, hkv, units)
        log_s = torch.where(valid, log_s - c.nms_strength * (local_max - log_s), neg_inf)

    # 5. cross-head exclusivity
    if c.use_exclusivity and hkv > 2:
        log_rho = torch.log_softmax(torch.where(valid, log_s, 0.0) / c.exclusivity_temperature, dim=1)
        log_s = torch.where(valid, log_s + c.exclusivity_strength * log_rho, neg_inf)

    if c.page_size > 1:
        return PageScores(log_s, token_log_s, c.page_size)
    return log_s
