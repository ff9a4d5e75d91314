"""The Selector's scores (steps 1-5) for a batch of slow rows in six launches, no host sync.

Reference (the spec): :func:`sfi_vllm.selector.batched_scores_static` applied to
``softmax(logits, -1)``; top-K stays in torch (:func:`sfi_vllm.selector.top_k_positions`).
The torch version is about a hundred small launches per layer; even replayed from a CUDA graph it
took 0.56 ms per layer at batch 1 x 8K on the H200, most of it per-launch cost. Here:

1. Statistics, with each (row, KV head)'s frame split across programs (``stat_splits``):
   ``_stats_partials`` (per split: running max and sum of the logits' exponentials for each query
   row of the GQA group, i.e. the slow step's softmax normaliser, never materialised; and the same
   for the prior), ``_stats_total`` (the pooled evidence, written once to the output buffer, and
   its sum), ``_stats_lambda`` (the adaptive lambda's two sums, from the pooled evidence); each
   merges the earlier passes' per-split partials itself. ``_stats_finish`` writes three scalars
   per (row, head). Only the first two passes read the ``G`` query rows' logits; the later ones
   read the pooled evidence, a quarter of the bytes at ``G = 4``.
2. ``_fused_log_s`` (row x head x tile) recomputes the prior and the fusion pointwise from those
   scalars and overwrites the pooled evidence with ``log s`` (``-inf`` past a row's candidates).
3. ``_nms_exclusivity`` (row x tile, all KV heads of the row in one tile): the soft-NMS local
   maximum over ``2R + 1`` shifted loads of ``log s``, then the cross-head exclusivity softmax
   over the head axis. Writes the final scores.

The SnapKV-style smoothing of the evidence (``smooth_kernel > 1``, a diagnostic policy) is not
implemented here: :func:`selector_scores` raises and callers keep the torch path for it. Page
selection (``page_size > 1``): ``_fused_log_s`` also writes each page's mass (log-sum-exp of its
``log s``; in torch, :func:`sfi_vllm.selector.page_mass`, where the page size is no power of two),
``_nms_exclusivity`` runs over the pages with the following pages
(:func:`sfi_vllm.selector.follow_spread`) folded into its loads, and the page scores are returned
with the tokens' ``log s`` (:class:`sfi_vllm.selector.PageScores`) for the top-K over pages
(:func:`sfi_vllm.selector.top_k_pages`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sfi_vllm.selector import PageScores, page_mass, page_radius

# The statistics passes split each (row, KV head)'s frame across programs, flash-decoding style.
# One program per (row, head) streaming a 128K frame was latency-bound on the H200 (3.2 ms per
# layer at 6 x 128K, 48 programs). The launch defaults (4096 programs, 8 warps, 1024-position
# fusion and soft-NMS tiles) are the fastest of benchmarks/selector_bench.py's configurations on the
# H200 at three of its four points and second at the fourth, 12-30% faster than 512 programs /
# 4 warps / 256 tiles, with the same top-K (results/selector-tune-h200.md).
TARGET_PROGRAMS = 4096
MAX_SPLITS = 64


@triton.jit
def _log_prior(KN, j, valid, n, lo, w_norm, w_pos, gamma, beta, eta, pos_power):
    """Unnormalised ``log r`` of candidates ``j`` (``-inf`` where not valid)."""
    jf = j.to(tl.float32)
    u = jf / tl.maximum(n - 1.0, 1.0)
    u_pow = tl.where(u > 0, tl.exp(pos_power * tl.log(tl.maximum(u, 1e-30))), 0.0)
    # 1 - u from the exact integer numerator, never as 1 - j / (n - 1): the GPU's division is
    # approximate, and as a reciprocal-multiply (n - 1) / (n - 1) is 1 - 2**-24 for n = 32508 and
    # 130812, which turns the last candidate's log(1 - u) from log(1e-30) = -69 into -16.6 (the
    # fused scores were then up to 4.1 away from the torch Selector at 32K and 128K frames);
    # `check_selector_scores` covers a 128K frame.
    rest = tl.where(n > 1.0, (n - 1.0 - jf) / tl.maximum(n - 1.0, 1.0), 1.0)
    pos = -beta * u_pow + eta * tl.log(tl.maximum(rest, 1e-30))
    kn = tl.load(KN + lo + j, mask=valid, other=1.0)
    norm = -gamma * tl.log(tl.maximum(kn, 1e-30))
    return tl.where(valid, w_norm * norm + w_pos * pos, float("-inf"))


@triton.jit
def _pooled(L, stride_lg, lse, j, valid, lo, offs_g, gmask, alpha, G: tl.constexpr):
    """Power mean over the group's query rows of ``softmax`` probabilities at candidates ``j``."""
    lg = tl.load(L + offs_g[:, None] * stride_lg + lo + j[None, :], mask=gmask[:, None] & valid[None, :],
                 other=float("-inf"))
    pa = tl.exp(alpha * (lg - lse[:, None]))  # p ** alpha
    m = tl.sum(pa, 0) / G
    pooled = tl.exp(tl.log(m) / alpha)  # m == 0 gives exp(-inf) = 0
    return tl.where(valid, pooled, 0.0)


@triton.jit
def _stats_partials(LOGITS, NORMS, N, M1, S1, MR, SR,
                    stride_lb, stride_lh, stride_lg, stride_nb, stride_nh,
                    frame, lo, width, chunk_f, chunk_w, w_norm, w_pos, gamma, beta, eta, pos_power,
                    HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, USE_PRIOR: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Pass 1 over one split of the frame: per query row of the group the running max and sum of
    ``exp(logit - max)`` over the row's candidates (each row's softmax over the candidates, split
    like flash-decoding), and the same for the prior's ``log r`` over the split's candidates."""
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    nsp = tl.num_programs(1)
    b = pid // HKV
    h = pid % HKV
    n = tl.load(N + b)
    L = LOGITS + b * stride_lb + h * stride_lh
    offs = tl.arange(0, BLOCK)
    offs_g = tl.arange(0, G_PAD)
    gmask = offs_g < G
    f0 = sp * chunk_f
    f1 = tl.minimum(f0 + chunk_f, frame)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    s = tl.zeros([G_PAD], tl.float32)
    for start in range(f0, f1, BLOCK):
        t = start + offs
        cand = (t < f1) & (t >= lo) & ((t - lo).to(tl.float32) < n)
        lg = tl.load(L + offs_g[:, None] * stride_lg + t[None, :], mask=gmask[:, None] & cand[None, :],
                     other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lg, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(lg - m_safe[:, None]), 1)
        m = m_new
    tl.store(M1 + (pid * nsp + sp) * G_PAD + offs_g, m)
    tl.store(S1 + (pid * nsp + sp) * G_PAD + offs_g, s)
    if USE_PRIOR:
        KN = NORMS + b * stride_nb + h * stride_nh
        w0 = sp * chunk_w
        w1 = tl.minimum(w0 + chunk_w, width)
        mr = float("-inf")
        sr = 0.0
        for start in range(w0, w1, BLOCK):
            j = start + offs
            valid = (j.to(tl.float32) < n) & (j < w1)
            x = _log_prior(KN, j, valid, n, lo, w_norm, w_pos, gamma, beta, eta, pos_power)
            mr_new = tl.maximum(mr, tl.max(x, 0))
            mr_safe = tl.where(mr_new == float("-inf"), 0.0, mr_new)
            sr = sr * tl.exp(mr - mr_safe) + tl.sum(tl.exp(x - mr_safe), 0)
            mr = mr_new
        tl.store(MR + pid * nsp + sp, mr)
        tl.store(SR + pid * nsp + sp, sr)


@triton.jit
def _merged_lse(M1, S1, pid, nsp, offs_g, gmask, G_PAD: tl.constexpr, S_PAD: tl.constexpr):
    """Each query row's log-sum-exp over its candidates, from the splits' (max, sum) pairs
    (0 for padding rows, so that ``_pooled`` never forms ``-inf - -inf``)."""
    offs_s = tl.arange(0, S_PAD)
    idx = (pid * nsp + offs_s[:, None]) * G_PAD + offs_g[None, :]
    smask = (offs_s < nsp)[:, None]
    m = tl.load(M1 + idx, mask=smask, other=float("-inf"))
    s = tl.load(S1 + idx, mask=smask, other=0.0)
    mm = tl.max(m, 0)
    mm_safe = tl.where(mm == float("-inf"), 0.0, mm)
    lse = mm + tl.log(tl.sum(s * tl.exp(m - mm_safe[None, :]), 0))
    return tl.where(gmask, lse, 0.0)


@triton.jit
def _merged_lse_prior(MR, SR, pid, nsp, S_PAD: tl.constexpr):
    offs_s = tl.arange(0, S_PAD)
    smask = offs_s < nsp
    m = tl.load(MR + pid * nsp + offs_s, mask=smask, other=float("-inf"))
    s = tl.load(SR + pid * nsp + offs_s, mask=smask, other=0.0)
    mm = tl.max(m, 0)
    mm_safe = tl.where(mm == float("-inf"), 0.0, mm)
    return mm + tl.log(tl.sum(s * tl.exp(m - mm_safe), 0))


@triton.jit
def _stats_total(LOGITS, N, M1, S1, TOT, POOL, stride_lb, stride_lh, stride_lg, stride_pb, stride_ph,
                 lo, width, chunk_w, alpha,
                 HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, S_PAD: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Pass 2 over one split: the pooled evidence over the split's candidates, written to ``POOL``
    (``(rows, Hkv, width)``; 0 past a row's candidates) for the later passes, and its sum."""
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    nsp = tl.num_programs(1)
    b = pid // HKV
    h = pid % HKV
    n = tl.load(N + b)
    L = LOGITS + b * stride_lb + h * stride_lh
    offs = tl.arange(0, BLOCK)
    offs_g = tl.arange(0, G_PAD)
    gmask = offs_g < G
    lse = _merged_lse(M1, S1, pid, nsp, offs_g, gmask, G_PAD, S_PAD)
    w0 = sp * chunk_w
    w1 = tl.minimum(w0 + chunk_w, width)
    PO = POOL + b * stride_pb + h * stride_ph
    total = 0.0
    for start in range(w0, w1, BLOCK):
        j = start + offs
        valid = (j.to(tl.float32) < n) & (j < w1)
        pooled = _pooled(L, stride_lg, lse, j, valid, lo, offs_g, gmask, alpha, G)
        tl.store(PO + j, pooled, mask=j < w1)
        total += tl.sum(pooled, 0)
    tl.store(TOT + pid * nsp + sp, total)


@triton.jit
def _stats_lambda(POOL, NORMS, N, MR, SR, TOT, NUM, DEN,
                  stride_pb, stride_ph, stride_nb, stride_nh,
                  lo, width, chunk_w, w_norm, w_pos, gamma, beta, eta, pos_power,
                  HKV: tl.constexpr, S_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 3 over one split: the split's share of the adaptive lambda's two sums,
    ``<f, f - r>`` and ``|f - r|^2`` (the pooled evidence read from pass 2's ``POOL``)."""
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    nsp = tl.num_programs(1)
    b = pid // HKV
    h = pid % HKV
    n = tl.load(N + b)
    PO = POOL + b * stride_pb + h * stride_ph
    KN = NORMS + b * stride_nb + h * stride_nh
    offs = tl.arange(0, BLOCK)
    offs_s = tl.arange(0, S_PAD)
    lse_r = _merged_lse_prior(MR, SR, pid, nsp, S_PAD)
    total = tl.sum(tl.load(TOT + pid * nsp + offs_s, mask=offs_s < nsp, other=0.0), 0)
    w0 = sp * chunk_w
    w1 = tl.minimum(w0 + chunk_w, width)
    num = 0.0
    den = 0.0
    for start in range(w0, w1, BLOCK):
        j = start + offs
        valid = (j.to(tl.float32) < n) & (j < w1)
        pooled = tl.load(PO + j, mask=valid, other=0.0)
        f = tl.where(total > 0, pooled / tl.maximum(total, 1e-30), tl.where(valid, 1.0 / n, 0.0))
        x = _log_prior(KN, j, valid, n, lo, w_norm, w_pos, gamma, beta, eta, pos_power)
        r = tl.where(valid, tl.exp(x - lse_r), 0.0)
        diff = f - r
        num += tl.sum(f * diff, 0)
        den += tl.sum(diff * diff, 0)
    tl.store(NUM + pid * nsp + sp, num)
    tl.store(DEN + pid * nsp + sp, den)


@triton.jit(do_not_specialize=["nsp"])  # the split count changes with the batch (S_PAD bounds it)
def _stats_finish(MR, SR, TOT, NUM, DEN, STATS, nsp, lam_max,
                  S_PAD: tl.constexpr, USE_PRIOR: tl.constexpr):
    """Merges the splits into the three scalars per (row, head) that ``_fused_log_s`` reads."""
    pid = tl.program_id(0)
    offs_s = tl.arange(0, S_PAD)
    smask = offs_s < nsp
    total = tl.sum(tl.load(TOT + pid * nsp + offs_s, mask=smask, other=0.0), 0)
    lse_r = float("-inf")
    lam = 0.0
    if USE_PRIOR:
        lse_r = _merged_lse_prior(MR, SR, pid, nsp, S_PAD)
        num = tl.sum(tl.load(NUM + pid * nsp + offs_s, mask=smask, other=0.0), 0)
        den = tl.sum(tl.load(DEN + pid * nsp + offs_s, mask=smask, other=0.0), 0)
        lam = tl.where(den > 0, num / tl.maximum(den, 1e-30), 0.0)
        lam = tl.minimum(tl.maximum(lam, 0.0), lam_max)
    tl.store(STATS + pid * 4 + 0, total)
    tl.store(STATS + pid * 4 + 1, lse_r)
    tl.store(STATS + pid * 4 + 2, lam)


@triton.jit
def _fused_log_s(NORMS, N, STATS, LOGS, PAGES,
                 stride_nb, stride_nh, stride_sb, stride_sh, stride_pb, stride_ph,
                 lo, width, units, w_norm, w_pos, gamma, beta, eta, pos_power,
                 HKV: tl.constexpr, USE_PRIOR: tl.constexpr, BLOCK: tl.constexpr, PAGE: tl.constexpr):
    """``LOGS`` holds pass 2's pooled evidence; each element is read and then overwritten with
    ``log s`` by the same program. ``PAGE > 1`` (a power of two dividing ``BLOCK``): also each
    page's mass, the log-sum-exp of its ``log s`` (:func:`sfi_vllm.selector.page_mass`), into
    ``PAGES``."""
    pid = tl.program_id(0)
    b = pid // HKV
    h = pid % HKV
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n = tl.load(N + b)
    valid = j.to(tl.float32) < n
    total = tl.load(STATS + pid * 4 + 0)
    pooled = tl.load(LOGS + b * stride_sb + h * stride_sh + j, mask=valid, other=0.0)
    f = tl.where(total > 0, pooled / tl.maximum(total, 1e-30), tl.where(valid, 1.0 / n, 0.0))
    log_f = tl.log(tl.maximum(f, 1e-30))
    if USE_PRIOR:
        lse_r = tl.load(STATS + pid * 4 + 1)
        lam = tl.load(STATS + pid * 4 + 2)
        x = _log_prior(NORMS + b * stride_nb + h * stride_nh, j, valid, n, lo, w_norm, w_pos, gamma, beta,
                       eta, pos_power)
        log_r = tl.where(valid, x - lse_r, 0.0)
        a = tl.log(tl.maximum(1.0 - lam, 1e-30)) + log_f
        c = tl.log(tl.maximum(lam, 1e-30)) + log_r
        mx = tl.maximum(a, c)
        log_s = mx + tl.log(tl.exp(a - mx) + tl.exp(c - mx))
        log_s = tl.where(lam > 0, log_s, log_f)
    else:
        log_s = log_f
    log_s = tl.maximum(log_s, -80.0)
    log_s = tl.where(valid, log_s, float("-inf"))
    tl.store(LOGS + b * stride_sb + h * stride_sh + j, log_s, mask=j < width)
    if PAGE > 1:
        x = tl.reshape(log_s, (BLOCK // PAGE, PAGE))
        m = tl.max(x, 1)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        mass = m_safe + tl.log(tl.sum(tl.exp(x - m_safe[:, None]), 1))  # a page of only -inf: -inf
        p = tl.program_id(1) * (BLOCK // PAGE) + tl.arange(0, BLOCK // PAGE)
        tl.store(PAGES + b * stride_pb + h * stride_ph + p, mass, mask=p < units)


@triton.jit
def _followed(base, jj, hmask, width, reach, penalty, FOLLOW: tl.constexpr):
    """Scores at positions ``jj`` (``-inf`` outside ``[0, width)``); with ``FOLLOW``, page mode's
    following pages: each the best of its own and its ``reach`` predecessors' less ``penalty`` per
    page of distance, ``-inf`` entries kept (:func:`sfi_vllm.selector.follow_spread`)."""
    v = tl.load(base + jj[None, :], mask=hmask[:, None] & ((jj >= 0) & (jj < width))[None, :],
                other=float("-inf"))
    if FOLLOW:
        out = v
        for d in range(1, reach + 1):
            jd = jj - d
            w = tl.load(base + jd[None, :], mask=hmask[:, None] & ((jd >= 0) & (jd < width))[None, :],
                        other=float("-inf"))
            out = tl.maximum(out, w - d * penalty)
        v = tl.where(v == float("-inf"), v, out)
    return v


@triton.jit
def _nms_exclusivity(LOGS, N, OUT, stride_sb, stride_sh, width, radius, nms_strength, excl_temp, excl_strength,
                     reach, penalty,
                     HKV: tl.constexpr, HKV_PAD: tl.constexpr, USE_NMS: tl.constexpr, USE_EXCL: tl.constexpr,
                     FOLLOW: tl.constexpr, BLOCK: tl.constexpr):
    """Steps 4-5 over tokens or pages (page mode, with ``FOLLOW``: the following pages first)."""
    b = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    offs_h = tl.arange(0, HKV_PAD)
    hmask = offs_h < HKV
    n = tl.load(N + b)
    valid = j.to(tl.float32) < n
    base = LOGS + b * stride_sb + offs_h[:, None] * stride_sh
    v = _followed(base, j, hmask, width, reach, penalty, FOLLOW)
    log_s = v
    if USE_NMS:
        local_max = v
        for d in range(-radius, radius + 1):
            w = _followed(base, j + d, hmask, width, reach, penalty, FOLLOW)
            local_max = tl.maximum(local_max, w)
        log_s = tl.where(valid[None, :], v - nms_strength * (local_max - v), float("-inf"))
    if USE_EXCL:
        z = tl.where(valid[None, :], log_s, 0.0) / excl_temp
        z = tl.where(hmask[:, None], z, float("-inf"))
        zm = tl.max(z, 0)
        log_rho = z - (zm + tl.log(tl.sum(tl.exp(z - zm[None, :]), 0)))[None, :]
        log_s = tl.where(valid[None, :], log_s + excl_strength * log_rho, float("-inf"))
    tl.store(OUT + b * stride_sb + offs_h[:, None] * stride_sh + j[None, :], log_s,
             mask=hmask[:, None] & (j < width)[None, :])


def stat_splits(programs: int, width: int, block: int, target: int = TARGET_PROGRAMS) -> int:
    """How many splits of the frame the statistics passes use: enough programs to fill the GPU
    (``target``), at most ``MAX_SPLITS``, and no split shorter than one ``block``."""
    return max(1, min(MAX_SPLITS, triton.cdiv(target, programs), triton.cdiv(width, block)))


def selector_scores(cfg, logits: torch.Tensor, norms: torch.Tensor, lo: int, n: torch.Tensor,
                    num_query_rows: int = 1, block: int = 1024, target_programs: int = TARGET_PROGRAMS,
                    num_warps: int = 8, tile: int = 1024, nms_tile: int = 1024,
                    nms_elems: int = 8192) -> torch.Tensor | PageScores:
    """``logits (B, Hkv, G, F)`` (the score kernel's, ``-inf`` past each row's context) and
    ``norms (B, Hkv, F)`` -> scores ``(B, Hkv, F - lo)`` of candidates ``lo + j`` (page mode:
    :class:`~sfi_vllm.selector.PageScores` over them), equal to
    ``batched_scores_static(Selector(cfg), softmax(logits), norms, lo, n)``. ``n (B,)`` float32:
    candidates per row. ``cfg`` is a :class:`sfi_vllm.config.SelectorConfig`. ``block`` and
    ``target_programs`` (the statistics passes), ``num_warps`` (every launch), ``tile`` (the fusion pass's
    tile, at most ``block``), ``nms_tile`` and ``nms_elems`` (the soft-NMS pass's positions per
    program, and its cap on heads x positions) are launch parameters: they change float summation order, not
    what is computed (``benchmarks/selector_bench.py`` times them)."""
    if cfg.smooth_kernel > 1:
        raise NotImplementedError("sfi-vllm: the fused selector has no evidence smoothing (smooth_kernel > 1)")
    B, hkv, g, frame = logits.shape
    assert norms.shape == (B, hkv, frame) and logits.stride(-1) == 1 and norms.stride(-1) == 1
    assert logits.dtype == torch.float32 and norms.dtype == torch.float32 and n.dtype == torch.float32
    width = frame - lo
    dev = logits.device
    g_pad = max(2, triton.next_power_of_2(g))
    stats = torch.empty(B * hkv, 4, dtype=torch.float32, device=dev)
    log_s = torch.empty(B, hkv, width, dtype=torch.float32, device=dev)  # pass 2's pooled evidence, then log s
    out = torch.empty_like(log_s) if cfg.page_size <= 1 else None  # steps 4-5's output (page mode: below)
    lam_max = cfg.lambda_max_multi if g * num_query_rows > 1 else cfg.lambda_max_single  # G x captured rows
    prior = (cfg.alpha, cfg.w_norm, cfg.w_pos, cfg.gamma, cfg.beta, cfg.eta, cfg.pos_power)
    P = B * hkv
    nsp = stat_splits(P, width, block, target_programs)
    chunk_w = triton.cdiv(triton.cdiv(width, nsp), block) * block
    chunk_f = triton.cdiv(triton.cdiv(frame, nsp), block) * block
    s_pad = max(2, triton.next_power_of_2(nsp))
    z = dict(dtype=torch.float32, device=dev)
    m1, s1 = torch.empty(P, nsp, g_pad, **z), torch.empty(P, nsp, g_pad, **z)
    mr, sr, tot, num, den = (torch.empty(P, nsp, **z) for _ in range(5))
    strides = (logits.stride(0), logits.stride(1), logits.stride(2))
    consts = dict(HKV=hkv, G=g, G_PAD=g_pad)
    _stats_partials[(P, nsp)](logits, norms, n, m1, s1, mr, sr, *strides, norms.stride(0), norms.stride(1),
                              frame, lo, width, chunk_f, chunk_w, *prior[1:],
                              USE_PRIOR=cfg.use_prior, BLOCK=block, num_warps=num_warps, **consts)
    _stats_total[(P, nsp)](logits, n, m1, s1, tot, log_s, *strides, log_s.stride(0), log_s.stride(1),
                           lo, width, chunk_w, cfg.alpha, S_PAD=s_pad, BLOCK=block, num_warps=num_warps, **consts)
    if cfg.use_prior:
        _stats_lambda[(P, nsp)](log_s, norms, n, mr, sr, tot, num, den, log_s.stride(0), log_s.stride(1),
                                norms.stride(0), norms.stride(1), lo, width, chunk_w, *prior[1:],
                                HKV=hkv, S_PAD=s_pad, BLOCK=block, num_warps=num_warps)
    _stats_finish[(P,)](mr, sr, tot, num, den, stats, nsp, lam_max, S_PAD=s_pad, USE_PRIOR=cfg.use_prior)
    tile = min(block, tile)
    page = cfg.page_size if cfg.page_size > 1 else 0
    units = -(-width // page) if page else width
    # the page masses in the fusion pass where a tile holds whole pages (a power-of-two page size)
    in_kernel = page and page & (page - 1) == 0 and page <= tile
    pages = torch.empty(B, hkv, units, dtype=torch.float32, device=dev) if in_kernel else log_s
    _fused_log_s[(B * hkv, triton.cdiv(width, tile))](
        norms, n, stats, log_s, pages, norms.stride(0), norms.stride(1), log_s.stride(0), log_s.stride(1),
        pages.stride(0), pages.stride(1), lo, width, units, *prior[1:], HKV=hkv, USE_PRIOR=cfg.use_prior,
        BLOCK=tile, PAGE=page if in_kernel else 0, num_warps=num_warps)
    use_excl = cfg.use_exclusivity and hkv > 2
    token_log_s = log_s
    n_units = n
    follow = bool(page) and cfg.follow_pages > 0
    if page:  # steps 4-5 (and the following pages) act on pages
        log_s = pages if in_kernel else page_mass(log_s, page).contiguous()
        n_units = n / page  # page i is valid iff i * page < n, i.e. i < n / page
        out = torch.empty_like(log_s)
    if cfg.use_nms or use_excl or follow:
        hkv_pad = max(2, triton.next_power_of_2(hkv))
        tile2 = max(16, min(nms_tile, nms_elems // hkv_pad))
        _nms_exclusivity[(B, triton.cdiv(units, tile2))](
            log_s, n_units, out, log_s.stride(0), log_s.stride(1), units, page_radius(cfg), cfg.nms_strength,
            cfg.exclusivity_temperature, cfg.exclusivity_strength, cfg.follow_pages, cfg.follow_penalty,
            HKV=hkv, HKV_PAD=hkv_pad, USE_NMS=cfg.use_nms, USE_EXCL=use_excl, FOLLOW=follow, BLOCK=tile2,
            num_warps=num_warps)
        log_s = out
    return PageScores(log_s, token_log_s, page) if page > 1 else log_s
