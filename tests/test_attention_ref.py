import pytest
import torch

from sfi_vllm.attention_ref import (
    attention_probs,
    dense_attention,
    fast_step_attention,
    merge_partials,
    partial_attention,
)


def brute_force(q, k, v, scale, keep=None):
    """float64 per-head loop; ``keep[h_kv]`` lists the key indices a KV head may attend to."""
    hq, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    out = torch.zeros(hq, d, dtype=torch.float64)
    for h in range(hq):
        kv = h // g
        idx = torch.arange(k.shape[1]) if keep is None else keep[kv]
        s = (k[kv, idx].double() @ q[h].double()) * scale
        p = torch.softmax(s, 0)
        out[h] = p @ v[kv, idx].double()
    return out


@pytest.mark.parametrize("hq,hkv", [(9, 3), (8, 8), (32, 8), (4, 1)])
def test_dense_matches_brute_force_gqa(hq, hkv, rng):
    d, n = 64, 300
    q, k, v = (torch.randn(*s, generator=rng) for s in ((hq, d), (hkv, n, d), (hkv, n, d)))
    got = dense_attention(q, k, v, 0.125)
    assert torch.allclose(got.double(), brute_force(q, k, v, 0.125), atol=1e-5)
    p = attention_probs(q, k, 0.125)
    assert p.shape == (hkv, hq // hkv, n)
    assert torch.allclose(p.sum(-1), torch.ones(hkv, hq // hkv))


def test_merge_of_disjoint_parts_is_exact(rng):
    hq, hkv, d, n = 9, 3, 64, 257
    q, k, v = (torch.randn(*s, generator=rng) * 2 for s in ((hq, d), (hkv, n, d), (hkv, n, d)))
    perm = torch.randperm(n, generator=rng)
    a, b = perm[:100], perm[100:]
    oa, la = partial_attention(q, k[:, a], v[:, a], 0.1)
    ob, lb = partial_attention(q, k[:, b], v[:, b], 0.1)
    out, lse = merge_partials(oa, la, ob, lb)
    full_out, full_lse = partial_attention(q, k, v, 0.1)
    assert torch.allclose(out, full_out, atol=1e-5)
    assert torch.allclose(lse, full_lse, atol=1e-5)


def test_empty_part_is_ignored(rng):
    q, k, v = torch.randn(4, 8, generator=rng), torch.randn(2, 5, 8, generator=rng), torch.randn(2, 5, 8, generator=rng)
    empty = k[:, :0]
    out = fast_step_attention(q, empty, empty, k, v, 0.3)
    assert torch.allclose(out, dense_attention(q, k, v, 0.3), atol=1e-6)


def test_fast_step_over_per_head_sets_matches_masked_dense(rng):
    """Compact sets differ per KV head; the window is shared; one softmax over both."""
    hq, hkv, d, n = 9, 3, 64, 200
    q, k, v = (torch.randn(*s, generator=rng) for s in ((hq, d), (hkv, n, d), (hkv, n, d)))
    sel = torch.stack([torch.sort(torch.randperm(150, generator=rng)[:20]).values for _ in range(hkv)])
    ck = torch.stack([k[h, sel[h]] for h in range(hkv)])
    cv = torch.stack([v[h, sel[h]] for h in range(hkv)])
    out = fast_step_attention(q, ck, cv, k[:, 150:], v[:, 150:], 0.125)
    keep = [torch.cat([sel[h], torch.arange(150, n)]) for h in range(hkv)]
    assert torch.allclose(out.double(), brute_force(q, k, v, 0.125, keep), atol=1e-5)


def test_causal_attention_probs_rows_see_keys_up_to_their_own_position():
    from sfi_vllm.attention_ref import attention_probs, causal_attention_probs

    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, 6, 16, generator=g)  # positions 35..39
    k = torch.randn(2, 50, 16, generator=g)
    p = causal_attention_probs(q, 40, k, 0.25).view(2, 3, 5, 50)
    for j in range(5):
        pos = 35 + j
        ref = attention_probs(q[j], k[:, :pos + 1], 0.25)  # (Hkv, G, pos + 1)
        torch.testing.assert_close(p[:, :, j, :pos + 1], ref)
        assert p[:, :, j, pos + 1:].abs().max() == 0
    with pytest.raises(ValueError):
        causal_attention_probs(q, 51, k, 0.25)
