"""``PackedCompactBuffer``'s double buffering through the repack kernel: a repack writes the spare
set, a publish switches to it."""

from __future__ import annotations

import pytest
import torch

from builders import block_tables, case, paged_cache, shape_id


def check_double_buffer(device="cuda", dtype=torch.bfloat16, hkv=8, d=128, page=16, seq_lens=(900, 500),
                        counts=(70, 40), seed=6):
    """A repack writes the slot's spare set and leaves the published one untouched until it is
    published (poisoned spares show any read of the wrong set)."""
    from sfi_vllm.compact import PackedCompactBuffer

    g = torch.Generator().manual_seed(seed)
    nb, bt = block_tables(seq_lens, page, 2, g, device)
    paged, kc, _ = paged_cache(nb, page, hkv, d, dtype, device, g)
    buf = PackedCompactBuffer(3, hkv, 128, d, dtype, device, double_buffer=True)
    buf.keys.fill_(float("nan"))
    buf.values.fill_(float("nan"))
    slots = [2, 0]

    def positions():
        pos = torch.zeros(len(seq_lens), hkv, max(counts), dtype=torch.long)
        for b, (s, c) in enumerate(zip(seq_lens, counts)):
            for h in range(hkv):
                pos[b, h, :c] = torch.randperm(s, generator=g)[:c].sort().values
        return pos.to(device)

    def expect(pos, b):
        return torch.stack([kc[bt[b, pos[b, h, :counts[b]] // page].long(), pos[b, h, :counts[b]] % page, h]
                            for h in range(hkv)])

    first = positions()
    buf.pack_rows(slots, [1, 1], paged, bt, first, list(counts), [800, 450])
    old_map = list(buf.slot_map)
    for b, slot in enumerate(slots):
        assert torch.equal(buf.published_keys(slot), expect(first, b))
    second = positions()
    targets = buf.pack_rows(slots, [2, 2], paged, bt, second, list(counts), [850, 460], publish=False)
    assert buf.slot_map == old_map and buf.slot_map_dev.tolist() == old_map, "published before publish()"
    for b, slot in enumerate(slots):
        assert targets[b] != old_map[slot] and targets[b] // 2 == slot, "repack must write the spare set"
        assert torch.equal(buf.published_keys(slot), expect(first, b)), "the published set was overwritten"
        assert torch.equal(buf.keys[targets[b], :, :counts[b]], expect(second, b))
    dev_targets = torch.tensor(targets, dtype=torch.int32, device=device)
    buf.publish(slots, [2, 2], targets, list(counts), [850, 460],
                torch.tensor(slots, device=device), dev_targets)
    assert buf.slot_map_dev.tolist() == buf.slot_map and buf.slot_map[1] == old_map[1]
    for b, slot in enumerate(slots):
        assert torch.equal(buf.published_keys(slot), expect(second, b))
        assert int(buf.window_start_dev[targets[b]]) == (850, 460)[b]
    return 0.0


CASES = [
    case("cpu", torch.float32, dict(hkv=2, d=32), id=shape_id(torch.float32, hkv=2, d=32)),
    case("cuda", torch.bfloat16, {}, id=shape_id(torch.bfloat16, hkv=8, d=128)),
]


@pytest.mark.parametrize("device,dtype,kw", CASES)
def test_double_buffer(device, dtype, kw):
    check_double_buffer(device, dtype, **kw)
