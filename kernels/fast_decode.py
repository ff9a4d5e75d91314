"""Fast-step decode attention: one softmax over the compact buffer and the paged recent window.

Reference: :func:`sfi_vllm.attention_ref.fast_step_attention` applied per row to
``compact_k[slot, :, :compact_len[slot]]`` and the window ``[ws, seq_len)`` read from vLLM's paged
cache (FlashAttention NHD layout: ``key_cache[block, offset, kv_head, :]``), where
``ws = max(window_start[slot], row_min_window_start[row])``; with a ``slot_map`` (double-buffered
compact sets) ``slot`` is first mapped to the physical set it publishes. A row whose slot is negative has no
compact set and attends densely to ``[0, seq_len)``; a row with ``seq_len == 0`` writes zeros.

Fused slow-step scores (``scores=``): a row whose ``score_base`` is not negative also writes what
:func:`sfi_vllm.kernels.slow_scores.slow_step_scores` would: its logits ``q . k * scale`` over
``[0, width)`` (``-inf`` from ``seq_len`` on) and the key norms (zero from ``seq_len`` on). A dense
row writes them from the keys it reads anyway, so a slow step inside a full CUDA graph needs no
second pass over the keys; a row with a compact set (a keys-only slow row, ``slow_attention:
keys``) attends through its set and window and reads the keys of ``[0, seq_len)`` once more, without
their values, for the scores. Layout, in units of one token's values (``Hq`` logits or ``Hkv``
norms): layer ``l``'s frame of the row starts at ``score_base + l * score_layer_stride`` and holds
``(Hkv, G, width)`` logits and ``(Hkv, width)`` norms, so the rows of one group of slow rows read as
one ``(layers, rows, Hkv, G, width)`` tensor (:class:`sfi_vllm.backends.step_refresh.StepRefresh`).

Everything per row and per slot is read from device tensors, so one launch over a fixed number of
rows (a CUDA-graph batch, padding rows included) serves any mix of fast and dense rows: the
captured graph reads the step's row -> slot table and the layer's per-slot lengths and window
starts at replay time.

Wide tiles (``wide_block_n``, off by default): a dense row of at least ``wide_from`` keys that
writes no scores reads its keys ``wide_block_n`` at a time, the other rows ``block_n`` at a time, in
the same launch. On the H200, 64-key tiles took 13-14% off dense rows at 128K contexts and added
15-17% at 16K-32K; compiled in, they left the fast rows' time within 3.3% at batches 1-8 and made it
31% slower at 16 x 16K, so the engine passes them only with ``sfi.experimental.wide_dense_tiles``,
for dense rows of at least 64K keys in launches of at most 8 rows
(benchmarks/results/wide-tiles-h200.txt).

Balanced splits (``row_splits``; the engine passes them to its uniform, CUDA-graph launches
unless ``sfi.balanced_splits`` is off, and never to eager ones): without them every row of a launch is cut into the same number of splits, so in a batch of mostly
fast rows (a few thousand keys each) a dense row (tens of thousands: a bridge row, a pool-full
fallback) runs on as few programs as a fast row, each reading several times the keys, and the
launch waits for them. With ``row_splits`` each row takes its own count, at most the grid's
``num_splits``; the host gives each row a share of the launch's programs in proportion to the keys
it reads (:func:`balanced_row_splits`), and the grid is made larger (:func:`balanced_num_splits`).
The programs past a row's count read only the row's table entries and write only an empty
log-sum-exp, which the merge skips. They skip the body, which is one branch: compiled with row
splits and score frames, a body outside a branch takes 112-114 registers instead of 96 (one
program fewer per SM; in such a kernel launches of one kind of row took 1.04-1.42x the other
rule's time at 16 x 16K and 8 x 32K on an H100, benchmarks/results/balanced-splits-kernel-h100.md).
In the branch the kernel keeps 96 registers. Without row splits the branch's condition is a constant and folds away. On an H100
(``benchmarks/mixed_rows_bench.py --engine-launch``) a launch with one or two dense or scored rows
among fast rows takes 0.31-0.53x the other rule's time at 16 x 16K, 8 x 32K and 6 x 128K, and one
of a single kind of row 0.99-1.03x (benchmarks/results/balanced-splits-e2e-h100.md, which has the
end-to-end runs too).

Flash-decoding style: grid ``(rows, kv_heads, splits)``. Each program takes the GQA group of one
KV head (its query heads padded to 16 rows for ``tl.dot``) over one slice of the row's virtual key
sequence ``compact ++ window``, keeps an online softmax, and writes a partial output and its
log-sum-exp; a second kernel merges the splits exactly.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


@triton.jit
def _window_tiles(q, m_i, l_i, acc, w_lo, hi, nc, ws, b, h, BT, KC, VC, stride_btb,
                  stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, lg_row, nm_row, gmask,
                  qk_scale, offs_n, offs_d, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                  WRITE: tl.constexpr):
    """The recent-window tiles of one program, read in place from the paged cache, folded into its
    online softmax. ``WRITE``: every tile also writes its logits and key norms (the caller has
    branched on the row being scored, so the loop without stores stays as it was)."""
    for start in range(w_lo, hi, BLOCK_N):
        n = start + offs_n
        nmask = n < hi
        pos = ws + n - nc
        blk = tl.load(BT + b * stride_btb + pos // PAGE, mask=nmask, other=0).to(tl.int64)
        off = (pos % PAGE).to(tl.int64)
        k = tl.load(KC + blk[:, None] * stride_kb + off[:, None] * stride_kt + h * stride_kh
                    + offs_d[None, :], mask=nmask[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        if WRITE:  # a scored dense row (window position == key position): its logits and key norms
            tl.store(lg_row + pos[None, :], qk * 0.6931471805599453, mask=gmask[:, None] & nmask[None, :])
            # the norms from a second load of the tile (an L1/L2 hit): reducing the tile loaded for
            # tl.dot made the kernel 2.5x slower on the H200 (benchmarks/fused_scores_bench.py)
            k2 = tl.load(KC + blk[:, None] * stride_kb + off[:, None] * stride_kt + h * stride_kh
                         + offs_d[None, :], mask=nmask[:, None], other=0.0).to(tl.float32)
            tl.store(nm_row + pos, tl.sqrt(tl.sum(k2 * k2, 1)), mask=nmask)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        v = tl.load(VC + blk[:, None] * stride_vb + off[:, None] * stride_vt + h * stride_vh
                    + offs_d[None, :], mask=nmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _key_scores(q, s, splits, seq, b, h, BT, KC, stride_btb, stride_kb, stride_kt, stride_kh, lg_row, nm_row,
                gmask, qk_scale, offs_n, offs_d, BLOCK_N: tl.constexpr, KEY_BLOCK: tl.constexpr,
                PAGE: tl.constexpr):
    """A keys-only slow row's scores over split ``s`` of ``splits`` of ``[0, seq)``: the logits and key norms that
    a dense row writes from its window tiles (the same dot products over the head dimension),
    without the values or the softmax. No state passes from tile to tile, so the tile
    (``KEY_BLOCK`` keys, a multiple of ``BLOCK_N``) sets only how many keys one program loads at
    once; the norms come from a second load of each ``BLOCK_N`` slice (an L1/L2 hit), as in the
    window tiles."""
    per = tl.cdiv(tl.cdiv(seq, splits), KEY_BLOCK) * KEY_BLOCK
    lo = s * per
    hi = tl.minimum(lo + per, seq)
    offs_k = tl.arange(0, KEY_BLOCK)
    for start in range(lo, hi, KEY_BLOCK):
        pos = start + offs_k
        nmask = pos < hi
        blk = tl.load(BT + b * stride_btb + pos // PAGE, mask=nmask, other=0).to(tl.int64)
        off = (pos % PAGE).to(tl.int64)
        k = tl.load(KC + blk[:, None] * stride_kb + off[:, None] * stride_kt + h * stride_kh + offs_d[None, :],
                    mask=nmask[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        tl.store(lg_row + pos[None, :], qk * 0.6931471805599453, mask=gmask[:, None] & nmask[None, :])
        for j in tl.static_range(0, KEY_BLOCK, BLOCK_N):
            if KEY_BLOCK == BLOCK_N:  # the tile itself: its block ids and offsets are loaded
                pj = pos
                mj = nmask
                bj = blk
                oj = off
            else:
                pj = start + j + offs_n
                mj = pj < hi
                bj = tl.load(BT + b * stride_btb + pj // PAGE, mask=mj, other=0).to(tl.int64)
                oj = (pj % PAGE).to(tl.int64)
            k2 = tl.load(KC + bj[:, None] * stride_kb + oj[:, None] * stride_kt + h * stride_kh + offs_d[None, :],
                         mask=mj[:, None], other=0.0).to(tl.float32)
            tl.store(nm_row + pj, tl.sqrt(tl.sum(k2 * k2, 1)), mask=mj)


@triton.jit
def _window_part(q, m_i, l_i, acc, lo, hi, nc, ws, b, h, BT, KC, VC, stride_btb,
                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, lg_row, nm_row,
                 gmask, qk_scale, offs_n, offs_d, dense_scored, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                 HAS_SCORES: tl.constexpr):
    """The window part of one program: virtual keys ``[max(lo, nc), hi)``, with the scores written
    for a scored dense row. One branch per program, above the loop: a branch or a predicated store
    inside every tile was slower (fused_scores_bench.py)."""
    if HAS_SCORES:
        if dense_scored:
            m_i, l_i, acc = _window_tiles(
                q, m_i, l_i, acc, tl.maximum(lo, nc), hi, nc, ws, b, h, BT, KC, VC, stride_btb,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, lg_row, nm_row,
                gmask, qk_scale, offs_n, offs_d, BLOCK_N, PAGE, True)
        else:
            m_i, l_i, acc = _window_tiles(
                q, m_i, l_i, acc, tl.maximum(lo, nc), hi, nc, ws, b, h, BT, KC, VC, stride_btb,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, lg_row, nm_row,
                gmask, qk_scale, offs_n, offs_d, BLOCK_N, PAGE, False)
    else:
        m_i, l_i, acc = _window_tiles(
            q, m_i, l_i, acc, tl.maximum(lo, nc), hi, nc, ws, b, h, BT, KC, VC, stride_btb,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, lg_row, nm_row,
            gmask, qk_scale, offs_n, offs_d, BLOCK_N, PAGE, False)
    return m_i, l_i, acc


# values that change with the batch (layer, stride_btb) or that need no specialization (wide_from)
@triton.jit(do_not_specialize=["layer", "stride_btb", "wide_from"])
def _fast_decode_split(
    Q, CK, CV, KC, VC, BT, ROW_SLOT, ROW_MIN_WS, SEQ, NC, WS, SLOT_MAP, ROW_SPLITS, ACC, LSE, STAGE,
    SC_BASE, SC_STRIDE, SC_WIDTH, LOGITS, NORMS, layer, wide_from,
    stride_qb, stride_qh, stride_stb, stride_sth,
    stride_cks, stride_ckh, stride_ckn,
    stride_cvs, stride_cvh, stride_cvn,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_btb,
    stride_ab, stride_ah, stride_as,
    stride_lb, stride_lh,
    scale,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_MAP: tl.constexpr, HAS_STAGE: tl.constexpr,
    HAS_SCORES: tl.constexpr, KEY_BLOCK: tl.constexpr, WIDE_N: tl.constexpr, HAS_ROW_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    slot = tl.load(ROW_SLOT + b)
    slot_raw = slot
    has_set = slot >= 0
    slot = tl.maximum(slot, 0)
    if HAS_MAP:  # logical slot -> its published physical set (double-buffered compact sets)
        slot = tl.where(has_set, tl.load(SLOT_MAP + slot), 0)
    slot = slot.to(tl.int64)
    nc = tl.where(has_set, tl.load(NC + slot), 0)
    ws = tl.where(has_set, tl.maximum(tl.load(WS + slot), tl.load(ROW_MIN_WS + b)), 0)
    seq = tl.load(SEQ + b)
    ws = tl.minimum(ws, seq)
    total = nc + seq - ws
    if HAS_ROW_SPLITS:  # this row's own split count (module doc, "Balanced splits")
        splits = tl.minimum(tl.maximum(tl.load(ROW_SPLITS + b), 1), NUM_SPLITS)
    else:
        splits = NUM_SPLITS
    active = s < splits  # an idle program (past its row's splits) reads no keys and writes only its LSE
    per = tl.cdiv(tl.cdiv(total, splits), BLOCK_N) * BLOCK_N
    if WIDE_N > 0:  # a dense row of at least wide_from keys that writes no scores: WIDE_N-key tiles
        wide = (slot_raw < 0) & (seq >= wide_from)
        if HAS_SCORES:
            wide = wide & (tl.load(SC_BASE + b) < 0)
        per = tl.where(wide, tl.cdiv(tl.cdiv(total, splits), WIDE_N) * WIDE_N, per)
    lo = s * per
    hi = tl.minimum(lo + per, total)

    # With row splits an idle program skips the body, and the body as one branch keeps the
    # kernel's registers at those of the kernel without row splits (module doc, "Balanced
    # splits"). Without row splits every program runs the body: ``run`` is a constant and the
    # branch folds away (benchmarks/kernel_registers.py keeps the PTX to compare the instructions).
    if HAS_ROW_SPLITS:
        run = active
    else:
        run = True
    if run:
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        gmask = offs_g < G
        amask = offs_g < tl.where(active, G, 0)  # gmask: every program that gets here is active
        q = tl.load(Q + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                    mask=amask[:, None], other=0.0)
        if HAS_STAGE:  # a copy of every row's query for the per-step refresh (split 0 writes it)
            if s == 0:
                tl.store(STAGE + b * stride_stb + (h * G + offs_g)[:, None] * stride_sth + offs_d[None, :], q,
                         mask=gmask[:, None])
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        qk_scale = scale * 1.4426950408889634  # exp2
        if HAS_SCORES:  # this row's frame in the fused scores (a negative base: not scored)
            sc_base = tl.load(SC_BASE + b).to(tl.int64)
            scored = sc_base >= 0
            dense_scored = scored & (slot_raw < 0)  # scored from its window tiles
            keys_scored = scored & (slot_raw >= 0)  # scored by a keys-only pass (_key_scores)
            sc_tok = tl.maximum(sc_base, 0) + layer * tl.load(SC_STRIDE + b).to(tl.int64)
            sc_w32 = tl.load(SC_WIDTH + b)
            sc_w = sc_w32.to(tl.int64)
            lg_row = LOGITS + sc_tok * (G * tl.num_programs(1)) + (h * G + offs_g).to(tl.int64)[:, None] * sc_w
            nm_row = NORMS + sc_tok * tl.num_programs(1) + h * sc_w

        # 1) the compact buffer: virtual keys [lo, min(hi, nc))
        c_hi = tl.minimum(hi, nc)
        ck_base = CK + slot * stride_cks + h * stride_ckh
        cv_base = CV + slot * stride_cvs + h * stride_cvh
        for start in range(lo, c_hi, BLOCK_N):
            n = start + offs_n
            nmask = n < c_hi
            k = tl.load(ck_base + n[:, None] * stride_ckn + offs_d[None, :], mask=nmask[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k)) * qk_scale
            qk = tl.where(nmask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            v = tl.load(cv_base + n[:, None] * stride_cvn + offs_d[None, :], mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new

        # 2) the recent window, read in place: virtual keys [max(lo, nc), hi) -> ws + (j - nc)
        if not HAS_SCORES:  # placeholders: the loop without stores never reads them
            lg_row = LOGITS + offs_g[:, None]
            nm_row = NORMS
            dense_scored = False
        if WIDE_N > 0:
            if wide:  # a long unscored dense row: wider tiles (module doc, "Wide tiles")
                m_i, l_i, acc = _window_tiles(
                    q, m_i, l_i, acc, lo, hi, 0, 0, b, h, BT, KC, VC, stride_btb,
                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, lg_row, nm_row,
                    gmask, qk_scale, tl.arange(0, WIDE_N), offs_d, WIDE_N, PAGE, False)
            else:
                m_i, l_i, acc = _window_part(
                    q, m_i, l_i, acc, lo, hi, nc, ws, b, h, BT, KC, VC, stride_btb,
                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, lg_row, nm_row,
                    gmask, qk_scale, offs_n, offs_d, dense_scored, BLOCK_N, PAGE, HAS_SCORES)
        else:
            m_i, l_i, acc = _window_part(
                q, m_i, l_i, acc, lo, hi, nc, ws, b, h, BT, KC, VC, stride_btb,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, lg_row, nm_row,
                gmask, qk_scale, offs_n, offs_d, dense_scored, BLOCK_N, PAGE, HAS_SCORES)

        if HAS_SCORES:
            if keys_scored:
                _key_scores(q, s, splits, seq, b, h, BT, KC, stride_btb, stride_kb, stride_kt, stride_kh, lg_row,
                            nm_row, gmask, qk_scale, offs_n, offs_d, BLOCK_N, KEY_BLOCK, PAGE)
            if scored & (s == splits - 1):  # the frame past the row's keys
                for start in range(seq, sc_w32, BLOCK_N):
                    n = start + offs_n
                    tmask = n < sc_w
                    tl.store(lg_row + n[None, :], tl.full([G_PAD, BLOCK_N], float("-inf"), tl.float32),
                             mask=gmask[:, None] & tmask[None, :])
                    tl.store(nm_row + n, tl.zeros([BLOCK_N], tl.float32), mask=tmask)

        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        heads = h * G + offs_g
        tl.store(ACC + b * stride_ab + heads[:, None] * stride_ah + s * stride_as + offs_d[None, :], out,
                 mask=amask[:, None])
        tl.store(LSE + b * stride_lb + heads * stride_lh + s, lse, mask=gmask)
    else:  # an idle program: no loads, only its empty log-sum-exp, which the merge skips
        offs_g = tl.arange(0, G_PAD)
        tl.store(LSE + b * stride_lb + (h * G + offs_g) * stride_lh + s,
                 tl.full([G_PAD], float("-inf"), tl.float32), mask=offs_g < G)


@triton.jit
def _merge_splits(ACC, LSE, OUT, stride_ab, stride_ah, stride_as, stride_lb, stride_lh,
                  stride_ob, stride_oh, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  S_PAD: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D)
    smask = offs_s < NUM_SPLITS
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)
    w = tl.where(smask, w, 0.0)
    # a split without keys (LSE -inf) has weight 0 and may have written no partial output
    acc = tl.load(ACC + b * stride_ab + h * stride_ah + offs_s[:, None] * stride_as + offs_d[None, :],
                  mask=smask[:, None] & (lse > float("-inf"))[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty))


# Keys per tile of a keys-only slow row's score pass (``_key_scores``); a multiple of ``block_n``.
KEY_BLOCK_N = 32


class ScoreFrames(NamedTuple):
    """Where the fused slow-step scores go (see the module doc): per row ``base``, ``layer_stride``
    and ``width`` (int32, ``base < 0``: not scored), the flat float32 ``logits`` and ``norms``
    buffers, and the launching layer's index."""
    base: torch.Tensor
    layer_stride: torch.Tensor
    width: torch.Tensor
    logits: torch.Tensor
    norms: torch.Tensor
    layer: int


def default_num_splits(rows: int, kv_heads: int, max_keys: int, target_programs: int = 528) -> int:
    """Enough splits to fill the GPU, but no split shorter than 256 keys, rounded down to a power
    of two. The split count is a compile-time constant of both kernels: unrounded, a draining batch
    (rows and keys changing every step) asks for a new value, and a new compilation of about a
    second, at nearly every eager step; rounded, there are at most seven."""
    want = triton.cdiv(target_programs, max(1, rows * kv_heads))
    n = int(max(1, min(want, triton.cdiv(max_keys, 256), 64)))
    return 1 << (n.bit_length() - 1)


# Programs a uniform launch aims for: 4 per SM of a 132-SM GPU (H100 SXM, H200). Triton's
# interpreter, which runs the programs one after another on the CPU, is given fewer by the kernel
# tests (tests/kernels/conftest.py), which still leaves several splits per row.
UNIFORM_TARGET_PROGRAMS = 528


def uniform_num_splits(rows: int, kv_heads: int, target_programs: int | None = None, one_wave: bool = False) -> int:
    """Splits for a CUDA-graph batch: a function of the batch shape only (contexts change from
    step to step while the graph stays fixed); splits past a row's keys exit at once. By default
    the smallest count whose programs (rows x KV heads x splits) reach ``target_programs``
    (default :data:`UNIFORM_TARGET_PROGRAMS`); ``one_wave``: the largest count whose programs stay
    within it (528: 132 SMs x 4 programs), so that on a 132-SM GPU no program waits for a second
    wave. At the same ``target_programs`` never more than the default, so a workspace sized by
    :func:`uniform_workspace_numel` (the default target) holds either."""
    if target_programs is None:
        target_programs = UNIFORM_TARGET_PROGRAMS
    programs = max(1, rows * kv_heads)
    n = target_programs // programs if one_wave else triton.cdiv(target_programs, programs)
    return int(max(1, min(64, n)))


# Programs, idle ones included, that a balanced launch's grid may hold (balanced_num_splits).
BALANCED_MAX_PROGRAMS = 2048


def balanced_num_splits(rows: int, kv_heads: int) -> int:
    """The grid's split count of a uniform launch with balanced splits: room for one row to take
    most of the launch's programs, within :data:`BALANCED_MAX_PROGRAMS` programs in all, never fewer
    than :func:`uniform_num_splits` nor more than 64. A function of the batch shape only."""
    room = BALANCED_MAX_PROGRAMS // max(1, rows * kv_heads)
    return int(max(uniform_num_splits(rows, kv_heads), min(64, room)))


def balanced_row_splits(work: list[int], kv_heads: int, target_programs: int | None = None,
                        block_n: int = 32) -> list[int]:
    """Each row's split count for a balanced launch: the launch's ``target_programs`` (default
    :data:`UNIFORM_TARGET_PROGRAMS`) shared among the rows in proportion to ``work`` (the keys each
    row reads), so that every program reads about as many keys, and never fewer than ``block_n``
    (one tile); at least 1 and at most 64 per row (the kernel also caps it at the grid's count). Rows
    of equal work get about :func:`uniform_num_splits` each."""
    if target_programs is None:
        target_programs = UNIFORM_TARGET_PROGRAMS
    total = sum(max(0, w) for w in work)
    per = max(block_n, -(-total * kv_heads // max(1, target_programs)))
    return [int(min(64, max(1, -(-max(0, w) // per)))) for w in work]


def uniform_workspace_numel(max_rows: int, q_heads: int, kv_heads: int, head_size: int,
                            balanced: bool = False) -> int:
    """float32 elements of the partial outputs + LSEs for any batch of up to ``max_rows`` rows;
    ``balanced``: for the grids of balanced splits (:func:`balanced_num_splits`) too."""
    def splits(b: int) -> int:
        return max(uniform_num_splits(b, kv_heads), balanced_num_splits(b, kv_heads) if balanced else 1)
    return max(b * q_heads * splits(b) * (head_size + 1) for b in range(1, max_rows + 1))


def fast_decode_attention(
    q: torch.Tensor,  # (B, Hq, D)
    compact_k: torch.Tensor,  # (slots, Hkv, C, D)
    compact_v: torch.Tensor,
    key_cache: torch.Tensor,  # (num_blocks, page, Hkv, D) view, last dim contiguous
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # (>= B, max_blocks) int32
    row_slot: torch.Tensor,  # (>= B,) int32: compact-buffer slot of each row, -1: dense row
    row_min_window_start: torch.Tensor,  # (>= B,) int32: the window starts here at the latest
    seq_lens: torch.Tensor,  # (>= B,) int32: tokens in the cache including this step's
    compact_len: torch.Tensor,  # (sets,) int32: sinks + selected tokens held by each set
    window_start: torch.Tensor,  # (sets,) int32: window start fixed at the set's last refresh
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    slot_map: torch.Tensor | None = None,  # (slots,) int32: slot -> physical set; None: identity
    stage: torch.Tensor | None = None,  # (>= B, Hq, D): receives a copy of q (query staging)
    row_splits: torch.Tensor | None = None,  # (>= B,) int32: each row's split count (balanced splits)
    scores: ScoreFrames | None = None,  # fused slow-step scores of the scored dense rows
    block_n: int = 32,
    key_block_n: int | None = None,
    wide_block_n: int = 0,
    wide_from: int = 0,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Fixed-shape for CUDA graphs: pass ``num_splits`` and ``workspace`` (from
    :func:`make_workspace`) and every launch reads only device tensors. With ``row_splits`` row
    ``b`` is cut into ``min(max(row_splits[b], 1), num_splits)`` splits instead of ``num_splits``
    (module doc, "Balanced splits"). With ``slot_map`` a
    row's slot ``s`` reads compact set ``slot_map[s]`` (and its length / window start). With
    ``stage`` the kernel also copies ``q`` there (the per-step refresh of slow rows that run inside
    a full CUDA graph reads it). With ``scores`` the scored dense rows also write their slow-step
    logits and key norms (module doc); the caller sizes the buffers for the frames it assigns.
    ``key_block_n``: the keys-only rows' score tile (a power of two and a multiple of ``block_n``;
    default :data:`KEY_BLOCK_N`, or ``block_n`` if larger). ``wide_block_n`` (0: off): the tile of
    the dense rows of at least ``wide_from`` keys that write no scores (module doc, "Wide tiles")."""
    B, Hq, D = q.shape
    Hkv = compact_k.shape[1]
    G = Hq // Hkv
    if out is None:
        out = torch.empty_like(q)
    acc, lse = workspace if workspace is not None else make_workspace(B, Hq, D, num_splits, q.device)
    for t in (q, compact_k, compact_v, key_cache, value_cache):
        assert t.stride(-1) == 1
    if stage is not None:
        assert stage.shape[0] >= B and stage.shape[1:] == q.shape[1:] and stage.stride(-1) == 1
    if scores is not None:
        assert scores.logits.dtype == torch.float32 and scores.norms.dtype == torch.float32
        assert scores.logits.is_contiguous() and scores.norms.is_contiguous()
    assert wide_block_n == 0 or (wide_block_n >= 16 and wide_block_n & (wide_block_n - 1) == 0), \
        "wide_block_n: 0 (off) or a power of two of at least 16"
    key_block = max(KEY_BLOCK_N, block_n) if key_block_n is None else key_block_n
    if scores is not None:  # only the keys-only pass uses it
        assert key_block > 0 and key_block % block_n == 0 and key_block & (key_block - 1) == 0, \
            "key_block_n: a power of two and a multiple of block_n"
    sc = scores if scores is not None else (row_slot, row_slot, row_slot, acc, acc, 0)
    _fast_decode_split[(B, Hkv, num_splits)](
        q, compact_k, compact_v, key_cache, value_cache, block_table, row_slot,
        row_min_window_start, seq_lens, compact_len, window_start,
        slot_map if slot_map is not None else row_slot, row_splits if row_splits is not None else row_slot,
        acc, lse, stage if stage is not None else q,
        *sc, wide_from,
        q.stride(0), q.stride(1), *((stage.stride(0), stage.stride(1)) if stage is not None else (0, 0)),
        compact_k.stride(0), compact_k.stride(1), compact_k.stride(2),
        compact_v.stride(0), compact_v.stride(1), compact_v.stride(2),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2),
        lse.stride(0), lse.stride(1),
        scale,
        G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, BLOCK_N=block_n,
        PAGE=key_cache.shape[1], NUM_SPLITS=num_splits, HAS_MAP=slot_map is not None,
        HAS_STAGE=stage is not None, HAS_SCORES=scores is not None, KEY_BLOCK=key_block,
        WIDE_N=wide_block_n, HAS_ROW_SPLITS=row_splits is not None, num_warps=num_warps, num_stages=num_stages,
    )
    _merge_splits[(B, Hq)](
        acc, lse, out, acc.stride(0), acc.stride(1), acc.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), D=D, NUM_SPLITS=num_splits,
        S_PAD=max(2, triton.next_power_of_2(num_splits)),
    )
    return out


def make_workspace(rows: int, q_heads: int, head_size: int, num_splits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    acc = torch.empty(rows, q_heads, num_splits, head_size, dtype=torch.float32, device=device)
    lse = torch.empty(rows, q_heads, num_splits, dtype=torch.float32, device=device)
    return acc, lse
