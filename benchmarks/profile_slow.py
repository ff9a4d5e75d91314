"""Profile one layer's slow-step selection work (score kernel, softmax, batched Selector, repack)
with torch.profiler: which ops take the time. ``python3 benchmarks/profile_slow.py B CONTEXT``."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from attn_timing import D, HKV, setup  # noqa: E402


def main() -> None:
    from sfi_vllm.compact import PackedCompactBuffer, selected_count, window_start
    from sfi_vllm.config import build_config
    from sfi_vllm.paged_kv import PagedKV
    from sfi_vllm.backends.selection import SlowStepSelection
    from sfi_vllm.selector import Selector

    B, ctx = int(sys.argv[1]), int(sys.argv[2])
    cfg = build_config({"preset": "balanced"}, use_env=False)
    kv, kc, vc, bt, q = setup(B, ctx)
    paged = PagedKV(kv.permute(0, 2, 1, 3), "flash", D)
    ws, k, sinks = window_start(cfg, ctx), selected_count(cfg, ctx), cfg.sinks
    buf = PackedCompactBuffer(B, HKV, sinks + k, D, q.dtype, q.device)
    sel = Selector(cfg.selector)
    lens = torch.full((B,), ctx, device="cuda", dtype=torch.int32)

    graphs = SlowStepSelection()

    def work():
        chosen = graphs.select(sel, q, paged.nhd_views()[0], bt, lens, [ctx] * B, sinks, [ws] * B, [k] * B, D ** -0.5)
        pos = torch.empty(B, HKV, sinks + k, dtype=torch.long, device="cuda")
        pos[..., :sinks] = torch.arange(sinks, device="cuda")
        pos[..., sinks:] = chosen
        buf.pack_rows(list(range(B)), [1] * B, paged, bt, pos, [sinks + k] * B, [ws] * B)

    for _ in range(3):
        work()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            work()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
