"""Plain-torch reference attention for one decode query: the spec for the fast-step kernels.

Shapes: ``q`` is ``(Hq, D)``; keys/values are ``(Hkv, n, D)`` with ``Hq = G * Hkv`` (GQA: query
head ``h`` reads KV head ``h // G``). Everything is computed in float32.
"""

from __future__ import annotations

import torch


def _grouped_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    hkv, n, d = k.shape
    hq = q.shape[0]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    qg = q.float().view(hkv, hq // hkv, d)
    return torch.einsum("hgd,hnd->hgn", qg, k.float()) * scale  # (Hkv, G, n)


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over one part of the keys: ``(out (Hq, D), lse (Hq,))``.

    An empty part gives ``out = 0`` and ``lse = -inf`` so that merging ignores it.
    """
    hkv, n, d = k.shape
    hq = q.shape[0]
    if n == 0:
        return q.new_zeros(hq, d, dtype=torch.float32), q.new_full((hq,), float("-inf"), dtype=torch.float32)
    s = _grouped_scores(q, k, scale)
    lse = torch.logsumexp(s, dim=-1)  # (Hkv, G)
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("hgn,hnd->hgd", p, v.float())
    return out.reshape(hq, d), lse.reshape(hq)


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact log-sum-exp merge of two partial attentions over disjoint key sets."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wa = torch.exp(lse_a - safe)[:, None]
    wb = torch.exp(lse_b - safe)[:, None]
    return wa * out_a + wb * out_b, lse


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one decode query over the whole history (keys already include itself)."""
    return partial_attention(q, k, v, scale)[0]


def attention_probs(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """The decode query's attention probabilities, ``(Hkv, G, n)``: what the Selector reads."""
    return torch.softmax(_grouped_scores(q, k, scale), dim=-1)


def causal_attention_probs(q: torch.Tensor, end: int, k: torch.Tensor, scale: float) -> torch.Tensor:
    """The attention probabilities of ``q (n, Hq, D)``, the queries of positions ``end - n`` to
    ``end - 1``, over the keys ``(Hkv, L, D)`` of positions ``0 .. L - 1``, each query seeing the
    keys up to its own position: ``(Hkv, G * n, L)``, the rows in ``(G, n)`` order."""
    n, hq, d = q.shape
    hkv, length, _ = k.shape
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    if end > length or end < n:
        raise ValueError(f"queries ending at position {end} do not fit {length} keys")
    qg = q.float().view(n, hkv, hq // hkv, d).permute(1, 2, 0, 3)  # (Hkv, G, n, D)
    s = torch.einsum("hgnd,hld->hgnl", qg, k.float()) * scale
    pos = torch.arange(end - n, end, device=k.device)
    future = torch.arange(length, device=k.device)[None, :] > pos[:, None]  # (n, L)
    s = s.masked_fill(future, float("-inf"))
    return torch.softmax(s, dim=-1).reshape(hkv, -1, length)


def fast_step_attention(
    q: torch.Tensor,
    compact_k: torch.Tensor,
    compact_v: torch.Tensor,
    window_k: torch.Tensor,
    window_v: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """A fast step: the compact set (sinks + selected, per KV head) and the recent window, one
    softmax over both (two partial attentions merged by log-sum-exp)."""
    oa, la = partial_attention(q, compact_k, compact_v, scale)
    ob, lb = partial_attention(q, window_k, window_v, scale)
    return merge_partials(oa, la, ob, lb)[0]
