import pytest
import torch

from sfi_vllm.paged_kv import PagedKV, probe_cpu_cache_order, transposed_key_order


def _fill(layout, block_size, num_blocks=12, heads=3, d=64, n=70, dtype=torch.float32, key_order=None):
    g = torch.Generator().manual_seed(block_size + heads)
    if layout == "flash":
        physical = torch.zeros(num_blocks, block_size, heads, 2 * d, dtype=dtype)
        cache = physical.permute(0, 2, 1, 3)  # logical (nb, H, bs, 2D) over the NHD physical layout
    else:
        cache = torch.zeros(num_blocks, heads, block_size, 2 * d, dtype=dtype)
    paged = PagedKV(cache, layout, d, key_order)
    blocks_needed = (n + block_size - 1) // block_size
    block_row = torch.randperm(num_blocks, generator=g)[:blocks_needed]
    pos = torch.arange(n)
    slots = block_row[pos // block_size] * block_size + pos % block_size
    k = torch.randn(n, heads, d, generator=g).to(dtype)
    v = torch.randn(n, heads, d, generator=g).to(dtype)
    paged.write(slots, k, v)
    return paged, block_row, k, v


@pytest.mark.parametrize("layout", ["flash", "cpu"])
@pytest.mark.parametrize("block_size", [16, 128])
def test_gather_returns_written_tokens(layout, block_size):
    order = transposed_key_order(block_size, 64) if layout == "cpu" else None
    paged, row, k, v = _fill(layout, block_size, key_order=order)
    pos = torch.tensor([0, 5, 17, 33, 69, 16, 1])
    gk, gv = paged.gather(row, pos)
    assert torch.equal(gk, k[pos].permute(1, 0, 2))
    assert torch.equal(gv, v[pos].permute(1, 0, 2))
    # per-head positions
    per_head = torch.tensor([[0, 9, 40], [3, 4, 69], [68, 2, 1]])
    hk, hv = paged.gather(row, per_head)
    for h in range(3):
        assert torch.equal(hk[h], k[per_head[h], h])
        assert torch.equal(hv[h], v[per_head[h], h])


@pytest.mark.parametrize("block_size,head_size", [(16, 64), (128, 64), (32, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_cache_order_matches_vllm_cache_write(block_size, head_size, dtype):
    """The probe must find where vLLM's own CPU cache-write op puts every key and value element
    (the ISA follows the dtype, block size and CPU: bf16 on a CPU with AMX packs the values of
    neighbouring tokens together)."""
    ops = pytest.importorskip("vllm._custom_ops")
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_size, "auto")

    def write(key, value, kc, vc, slots):
        ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")

    key_order, value_order = probe_cpu_cache_order(write, block_size, head_size, dtype)
    # Write real data through vLLM's op and read it back through PagedKV.
    nb, h, n = 6, 3, 3 * block_size - 5
    cache = torch.zeros(nb, h, block_size, 2 * head_size, dtype=dtype)
    kc, vc = cache.view(nb, h, 2 * block_size, head_size).chunk(2, dim=2)
    row = torch.tensor([4, 0, 2])
    pos = torch.arange(n)
    slots = row[pos // block_size] * block_size + pos % block_size
    k = torch.randn(n, h, head_size).to(dtype)
    v = torch.randn(n, h, head_size).to(dtype)
    write(k, v, kc, vc, slots)
    gk, gv = PagedKV(cache, "cpu", head_size, key_order, value_order).gather(row, pos)
    assert torch.equal(gk, k.permute(1, 0, 2))
    assert torch.equal(gv, v.permute(1, 0, 2))
