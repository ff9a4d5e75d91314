"""End-to-end decode throughput on the GPU, SFI vs dense, same run (vLLM 0.26, one H200).

    python3 benchmarks/e2e_bench.py --out DIR --points 1x8192,1x32768,16x16384,8x32768
    python3 benchmarks/e2e_bench.py --out DIR --points 1x131072,6x131072 --tag -128k
    python3 benchmarks/e2e_bench.py --out DIR --points 1x8192 --sfi '{"side_stream": false}' --tag -inline
    python3 benchmarks/e2e_bench.py --out DIR --points 1x8192 --slow-probe --variant eager_slow='{"slow_in_graph": false}'
    python3 benchmarks/e2e_bench.py --out DIR --points 8x32768 --tp 2 --tag -tp2      # two GPUs (not yet run)
    python3 benchmarks/e2e_bench.py --out DIR --points 8x32768 --modes dense,lossless,spec_dense \
        --spec '{"num_speculative_tokens": 4, "synthetic_acceptance_length": 4.5}' --tag -lossless

Model: Qwen3-4B shape (36 layers, 32 q / 8 KV heads, head_dim 128, bf16) written as a safetensors
checkpoint with random normal weights (std 0.02, norms 1.0): not vLLM's dummy loader, whose
+-1e-3 weights make attention flat. Prompts are random token ids; decode is greedy with
ignore_eos; prefix caching on, so the timed run re-prefills only the last prompt token. Decode
throughput = batch x (new tokens - 1) / (time of the generate call - time of a cached one-token
call). Before the engines, the same run times each point's attention per layer (attn_timing.py):
FA3 decode, the fast-step kernel over SFI's working set, and a slow step's selection work; from
them ``achievable_ratio`` (see :func:`achievable_ratio`). Writes e2e-h200<tag>.jsonl (batch,
context, dense_tok_s, sfi_tok_s, ratio, achievable_ratio, slow_step_rate, the attention times) and
prints it. ``--tp N`` runs every engine with N tensor-parallel workers (vLLM's mp executor); the
attention times are then still those of one GPU holding every head, so ``achievable_ratio`` is left
out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560,
    "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 131072 + 4096,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "hidden_act": "silu", "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
}


def make_model(path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    if (path / "model.safetensors").exists():
        return
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    g = torch.Generator(device="cuda").manual_seed(0)
    c = CONFIG
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d

    def w(*shape):
        return (torch.randn(*shape, generator=g, device="cuda") * 0.02).to(torch.bfloat16).cpu()

    t = {"model.embed_tokens.weight": w(c["vocab_size"], h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for L in range(c["num_hidden_layers"]):
        p = f"model.layers.{L}."
        t.update({p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
                  p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
                  p + "self_attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
                  p + "self_attn.k_norm.weight": torch.ones(d, dtype=torch.bfloat16),
                  p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                  p + "mlp.down_proj.weight": w(h, i),
                  p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                  p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)})
    save_file(t, str(path / "model.safetensors"))


def make_tokenizer(path: Path) -> None:
    """A word-level tokenizer over the model's whole vocabulary, for serving the checkpoint over
    HTTP (``serve_bench.sh``: ``vllm bench serve``'s random prompts and the server's detokenizer
    need one): token i is the word ``w<i>``, except a few punctuation tokens (so the boundary
    trigger has sentence enders) and the special tokens of CONFIG."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if (path / "tokenizer.json").exists():
        return
    vocab = {f"w{i}": i for i in range(CONFIG["vocab_size"])}
    for i, text in {13: ".", 0: "!", 30: "?", 11: ","}.items():
        del vocab[f"w{i}"]
        vocab[text] = i
    specials = {CONFIG["bos_token_id"]: "<|endoftext|>", CONFIG["eos_token_id"]: "<|im_end|>",
                CONFIG["bos_token_id"] + 1: "<unk>"}
    for i, text in specials.items():
        del vocab[f"w{i}"]
        vocab[text] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<|endoftext|>",
                                 eos_token="<|im_end|>")
    hf.save_pretrained(str(path))


SFI = {"preset": "speed"}  # pages, no bridge, slow step every 21 steps; --variant NAME='{...}' times others
# --slow-probe: the SFI engine also times each point with a slow step every other step (a
# per-request override, so the probe shares the engine and its prefix cache); with the two runs'
# step times and slow-step rates, the time of a slow and of a fast step follow (two equations).
PROBE = {"reuse_budget": 1, "min_gap": 0}
MODES = {"dense": None, "sfi": SFI}
# --spec: speculative decoding with the checkpoint as its own drafter (vLLM's draft_model), with
# drafts accepted at a set mean rate (vLLM's synthetic rejection sampling: random weights accept
# nothing meaningful, so the acceptance measured on a real model is imposed). "lossless" drafts
# with SFI (sfi.mode lossless, the --sfi settings' working set), "spec_dense" with dense attention
# (vLLM's own speculative decoding, the control).
SPEC_MODES = {"lossless": {"mode": "lossless", "experimental": {"synthetic_acceptance": True}}, "spec_dense": None}
# Random token ids have no sentences; the speed preset has no boundary trigger and a reuse budget
# of 20 fast steps: one slow step every 21 steps (~4.8%), about the rate the sentence trigger gave
# on real generations of the test model (1 per ~18-24 steps). Row j's prompt is j tokens shorter
# than the point's context (--same-length: every row's is the context), so that with
# sfi.reuse_stagger on (it derives a reuse phase from the context length and the prompt's tokens)
# requests of one batch, which start together, take different reuse phases, as requests arriving
# apart do in serving. The stagger is on by default; with it off ('{"reuse_stagger": false}')
# every row of a batch refreshes on the same steps (lockstep).


def run(model: str, points: list[tuple[int, int]], new_tokens: int, sfi: dict | None, mode: str,
        probe: bool = False, tp: int = 1, spec: dict | None = None, repeats: int = 1,
        request_variants: dict[str, dict] | None = None, itl: bool = False,
        same_length: bool = False) -> list[dict]:
    """One engine serves every point (same max_num_seqs / max_model_len): for each, a prefill-only
    pass fills the prefix cache, then per variant (the engine's settings; ``request_variants``:
    per-request settings over them, named; with ``probe`` also the slow-step probe) a warm-up
    decode (:func:`warmup_tokens`) compiles what the decode steps need (Triton kernels, SFI's
    selection graphs for this context), then ``repeats`` times a cached one-token pass (the
    residual) and the timed run; each timed run is a result of its own (``repeat`` 1, 2, ...).
    CUDA-graph capture sizes: :func:`capture_sizes`. With ``itl`` the timed run steps the engine
    here (:func:`generate_stepped`) and its row gets the inter-token latencies."""
    import torch
    from vllm import LLM, SamplingParams

    kw = dict(model=model, skip_tokenizer_init=True, max_model_len=max(c for _, c in points) + new_tokens + 16,
              max_num_seqs=max(b for b, _ in points), enable_prefix_caching=True,
              gpu_memory_utilization=float(os.environ.get("SFI_BENCH_GPU_MEM", "0.92")),
              max_num_batched_tokens=16384, seed=0, enforce_eager=False,
              compilation_config={"cudagraph_capture_sizes": capture_sizes([b for b, _ in points], spec)})
    if sfi is not None:
        kw.update(attention_backend="sfi", additional_config={"sfi": sfi})
    if tp > 1:
        kw.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
    if spec is not None:
        kw["speculative_config"] = {"method": "draft_model", "model": model, "rejection_sample_method": "synthetic",
                                    **spec}
    llm = LLM(**kw)
    variants = ({mode: None} | {name: over for name, over in (request_variants or {}).items()}
                | ({f"{mode}_probe": PROBE} if probe else {}))
    out = []
    for batch, context in points:
        g = torch.Generator().manual_seed(batch * 7 + context)
        prompts = [{"prompt_token_ids": torch.randint(1000, 100000, (context - (0 if same_length else j),),
                                                      generator=g).tolist()}
                   for j in range(batch)]
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), use_tqdm=False)
        t_fill = time.perf_counter() - t
        for name, over in variants.items():
            extra = {"extra_args": {"sfi": over}} if over else {}
            one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, **extra)
            full = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, **extra)
            llm.generate(prompts, SamplingParams(max_tokens=warmup_tokens(sfi, over, new_tokens), temperature=0,
                                                 ignore_eos=True, **extra), use_tqdm=False)
            for repeat in range(1, repeats + 1):
                out.append(_timed(llm, prompts, one, full, sfi, spec, name, batch, context, new_tokens, t_fill, repeat,
                                  itl))
    return out


def _timed(llm, prompts, one, full, sfi, spec, name, batch, context, new_tokens, t_fill, repeat,
           itl: bool = False) -> dict:
    """One timed run of a point: the cached one-token pass, then ``full``; the result row (with
    ``itl``: ``full`` through :func:`generate_stepped`, and :func:`itl_stats` of it)."""
    t = time.perf_counter(); llm.generate(prompts, one, use_tqdm=False); t_pre = time.perf_counter() - t
    before = _stats_totals(llm) if sfi is not None else None
    reads0 = _token_reads()
    misses0 = _fused_score_misses()
    graphs0 = _graph_runs()
    t = time.perf_counter()
    arrivals = generate_stepped(llm, prompts, full) if itl else llm.generate(prompts, full, use_tqdm=False)
    t_full = time.perf_counter() - t
    decode_tok = batch * (new_tokens - 1)
    res = dict(mode=name, batch=batch, context=context, repeat=repeat, prefill_s=round(t_fill, 2),
               cached_first_token_s=round(t_pre, 3), generate_s=round(t_full, 3),
               decode_tok_s=round(decode_tok / max(t_full - t_pre, 1e-6), 1))
    if itl:
        res.update(itl_stats(arrivals))
    if sfi is not None:
        after = _stats_totals(llm)
        slow, dec = after[0] - before[0], after[1] - before[1]
        reads1 = _token_reads()
        if reads0 is not None and reads1 is not None and reads1[1] > reads0[1]:
            # planned steps that read the sampled tokens to the host (a device sync each)
            res["token_reads_per_step"] = round((reads1[0] - reads0[0]) / (reads1[1] - reads0[1]), 4)
            if len(reads1) > 2:  # boundary_read "lagged": reads whose copy was not done yet
                res["token_waits_per_step"] = round((reads1[2] - reads0[2]) / (reads1[1] - reads0[1]), 4)
        misses1 = _fused_score_misses()
        if misses0 is not None and misses1 is not None:
            # slow steps in a graph whose rows did not fit the fused score buffers
            res["fused_score_misses"] = misses1 - misses0
        # how the selection and the drafter's passes ran in the timed run (captures in it
        # are pauses that the warm-up did not take)
        res.update({k: v - graphs0.get(k, 0) for k, v in _graph_runs().items()})
        if spec is not None:  # tokens per verify step, as the SFI statistics count them
            res["tokens_per_verify"] = round((after[5] - before[5] + after[6] - before[6])
                                             / max(after[6] - before[6], 1), 3)
        if after[7] > before[7]:  # their steps were dense: the row does not measure SFI
            res["dense_fallbacks"] = after[7] - before[7]
            print(f"WARNING: {after[7] - before[7]} requests of {name} ran with dense attention (a full compact-set "
                  "pool, sfi.compact_memory_gib, or a bad config): this row does not measure SFI", flush=True)
        res.update(slow_step_rate=round(slow / max(dec, 1), 4),
                   dense_step_rate=round((after[4] - before[4]) / max(dec, 1), 4),
                   attended_fraction=round((after[2] - before[2]) / max(after[3] - before[3], 1), 4))
    print("RESULT " + json.dumps(res), flush=True)
    return res


def generate_stepped(llm, prompts: list, params) -> dict[str, list[tuple[float, int]]]:
    """What ``llm.generate(prompts, params)`` does, stepping the engine here so that each output's
    arrival is timed: per request, ``(host time, new tokens)`` for every engine step that gave it
    tokens (a verify step can give several). The outputs are deltas (vLLM's ``DELTA`` kind): one
    small output object per request and step, where ``generate`` builds them only at the end.
    With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engines here) a step's return is when its
    tokens are on the host, as a server's streamed chunk would be."""
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    arrivals: dict[str, list[tuple[float, int]]] = {}
    stamp = time.monotonic_ns()
    for i, prompt in enumerate(prompts):
        p = params.clone()
        p.output_kind = RequestOutputKind.DELTA
        engine.add_request(f"timed-{stamp}-{i}", prompt, p)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for o in outputs:
            n = sum(len(c.token_ids) for c in o.outputs)
            if n:
                arrivals.setdefault(o.request_id, []).append((now, n))
    return arrivals


def itl_stats(arrivals: dict[str, list[tuple[float, int]]]) -> dict:
    """Inter-token latencies of :func:`generate_stepped`'s arrivals, as ``vllm bench serve`` counts
    them: the gaps between a request's successive outputs after its first (one gap per output,
    whatever its token count), over every request; ms, with their count."""
    import numpy as np

    gaps = np.array([b[0] - a[0] for times in arrivals.values() for a, b in zip(times, times[1:])]) * 1e3
    if gaps.size == 0:
        return {"itl_count": 0}
    p50, p90, p99 = np.percentile(gaps, [50, 90, 99])
    return {"itl_count": int(gaps.size), "itl_p50_ms": round(float(p50), 2), "itl_p90_ms": round(float(p90), 2),
            "itl_p99_ms": round(float(p99), 2), "itl_max_ms": round(float(gaps.max()), 2),
            "itl_mean_ms": round(float(gaps.mean()), 2)}


def capture_sizes(batches: list[int], spec: dict | None) -> list[int]:
    """CUDA-graph capture sizes (tokens per step): each batch of the run, so that a decode step
    replays a graph of its own size, and with speculative decoding each batch's verify step,
    batch x (num_speculative_tokens + 1) tokens. With speculative decoding vLLM 0.26 (V1 runner,
    full decode graphs) rounds the sizes up to multiples of num_speculative_tokens + 1 and drops
    those that then exceed the largest size given
    (``CompilationConfig.adjust_cudagraph_sizes_for_spec_decode``): without the verify sizes a
    verify step of 8 rows x 5 tokens ran with no CUDA graph at all. The drafter's one-token passes
    are still padded to a multiple of num_speculative_tokens + 1 (8 rows to 10)."""
    sizes = {1, 2, 4, 8, 16, *batches}
    if spec is not None:
        k = int(spec.get("num_speculative_tokens", 1))
        sizes |= {b * (k + 1) for b in batches}
    return sorted(sizes)


def warmup_tokens(sfi: dict | None, over: dict | None, new_tokens: int) -> int:
    """Tokens of a point's warm-up call: past the first selection (after the dense bridge) and
    three more slow steps, so that the selection's kernels are compiled and its CUDA graphs
    captured (from a shape's third step on) before the timed run; a warm-up that ended inside the
    bridge left all of that to the timed run (benchmarks/results/e2e-h200-default.md)."""
    if sfi is None:
        return 4
    from sfi_vllm.config import build_config

    cfg = build_config({**sfi, **(over or {})}, use_env=False)
    return max(4, min(new_tokens, cfg.bridge_steps + 3 * (cfg.reuse_budget + 1) + 2))


def _token_reads() -> tuple[int, ...] | None:
    """(host reads of sampled tokens, planned steps[, reads that had to wait]) of the in-process
    SFI controller; None when there is none (dense, or tensor-parallel workers in other processes).
    The third entry exists when the tokens are read a step late (``boundary_read`` "lagged", or
    "auto" on a GPU)."""
    from sfi_vllm.controller import current_controller

    ctl = current_controller()
    if ctl is None or ctl.tokens is None:  # (no reader before the first decode step)
        return None
    waits = getattr(ctl.tokens, "waits", None)
    return (ctl.tokens.reads, ctl.tokens.steps) + (() if waits is None else (waits,))


def _graph_runs() -> dict[str, int]:
    """The in-process controller's CUDA-graph runs so far (sfi_cuda_graph_runs): the selection's
    (``selection_graph_replay`` / ``_capture`` / ``_eager``) and, with ``sfi.drafter_graphs``, the
    drafter's passes (``drafter_graph_*``); empty where there is no such controller."""
    from sfi_vllm.controller import current_controller

    ctl = current_controller()
    out: dict[str, int] = {}
    if ctl is not None and ctl.executor is not None:
        out.update({f"selection_graph_{k}": v for k, v in ctl.executor.graph_runs().items()})
    if ctl is not None and ctl.drafter_graph_wrapper is not None:
        out.update({f"drafter_graph_{k}": v for k, v in ctl.drafter_graph_wrapper.counters().items()})
    return out


def _fused_score_misses() -> int | None:
    """Steps whose slow rows did not fit ``fused_scores_tokens`` (in-process controller with fused
    scores on; else None)."""
    from sfi_vllm.controller import current_controller

    ctl = current_controller()
    executor = None if ctl is None else ctl.executor
    if executor is None or executor.fused_scores is None:
        return None
    return executor.fused_score_misses


def _stats_totals(llm) -> tuple[int, ...]:
    """Summed over requests: slow steps, decode steps, fast attended and context tokens, dense
    steps, accepted drafts, verify steps, requests that ran densely instead (a full compact-set
    pool, a bad config)."""
    from sfi_vllm.controller import current_controller
    from sfi_vllm.tools.engine_job import _worker_sfi_info

    ctl = current_controller()
    if ctl is not None:
        st = [s.to_dict() for s in ctl.stats.snapshot().values()]
    else:  # tensor-parallel workers in other processes: rank 0's statistics
        ranks = sorted((r for r in llm.collective_rpc(_worker_sfi_info) if r is not None), key=lambda r: r["rank"])
        st = list(ranks[0]["stats"].values())
    return (sum(s["slow_steps"] for s in st), sum(s["decode_steps"] for s in st),
            sum(s["fast_attended_tokens"] for s in st), sum(s["fast_context_tokens"] for s in st),
            sum(s["dense_steps"] for s in st), sum(s.get("accepted_tokens", 0) for s in st),
            sum(s.get("verify_steps", 0) for s in st), sum(bool(s.get("fallback")) for s in st))


def attention_times(batch: int, context: int) -> dict:
    """Per-layer attention times of this point, same run: FA3 decode over the context, the fast-step
    kernel over the SFI working set (CUDA-graph split count), and a slow step's selection work."""
    import torch

    from attn_timing import WINDOW, fa3_us, setup, sfi_fast_us, slow_select_us
    from sfi_vllm.backends.selection import FUSED_MAX_FRAME, SlowStepSelection
    from sfi_vllm.compact import selected_count, window_start
    from sfi_vllm.config import build_config

    cfg = build_config(MODES["sfi"], use_env=False)
    kv, kc, vc, bt, q = setup(batch, context)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    dense = fa3_us(q, kc, vc, bt, lens, context)
    ws = window_start(cfg, context)
    n_compact = cfg.sinks + selected_count(cfg, context)
    fast, _ = sfi_fast_us(q, kc, vc, bt, lens, n_compact, ws, uniform=True)
    # both Selector paths, so that the engine's bound between them (FUSED_MAX_FRAME) can be checked;
    # slow_select_us is the one the engine takes at this context
    fused = slow_select_us(kv, q, bt, context, cfg, fused_max_frame=1 << 30)
    torch_path = slow_select_us(kv, q, bt, context, cfg, fused_max_frame=0)
    # decode contexts are context + 1 ... context + new tokens: the frame is rounded up from there
    engine_fused = SlowStepSelection.frame_width(context + 1) <= FUSED_MAX_FRAME
    select = fused if engine_fused else torch_path
    del kv, kc, vc
    torch.cuda.empty_cache()
    return dict(dense_attn_us=round(dense, 1), fast_attn_us=round(fast, 1), slow_select_us=round(select, 1),
                slow_select_fused_us=round(fused, 1), slow_select_torch_us=round(torch_path, 1),
                working_set=n_compact + context - ws, window=WINDOW)


def achievable_ratio(row: dict, layers: int = 36) -> float:
    """dense step / (dense step - dense attention + fast attention, with the slow steps' share:
    a slow step is a dense step plus its selection work)."""
    t = row["batch"] / row["dense_tok_s"]
    rho = row["sfi_slow_step_rate"]
    fast_step = t - layers * (row["dense_attn_us"] - row["fast_attn_us"]) * 1e-6
    slow_step = t + layers * row["slow_select_us"] * 1e-6
    return t / ((1 - rho) * fast_step + rho * slow_step)


def step_times(row: dict, name: str = "sfi") -> dict:
    """Measured slow- and fast-step times from an SFI engine's run and its slow-step probe
    (``name``: the engine's key prefix): ``t = t_fast + rate x (t_slow - t_fast)`` for both runs,
    solved for the two unknowns."""
    b = row["batch"]
    t_dense, t1, t2 = b / row["dense_tok_s"], b / row[f"{name}_tok_s"], b / row[f"{name}_probe_tok_s"]
    r1, r2 = row[f"{name}_slow_step_rate"], row[f"{name}_probe_slow_step_rate"]
    # the dense bridge's steps (rate d) cost a dense step: t - d x t_dense = (1 - d) t_fast + r x delta
    d1, d2 = row.get(f"{name}_dense_step_rate", 0.0), row.get(f"{name}_probe_dense_step_rate", 0.0)
    if r2 - r1 < 0.1:
        return {}
    y1, y2 = t1 - d1 * t_dense, t2 - d2 * t_dense
    det = (1 - d1) * r2 - (1 - d2) * r1
    t_fast = (y1 * r2 - y2 * r1) / det
    delta = ((1 - d1) * y2 - (1 - d2) * y1) / det
    t_slow = t_fast + delta
    return dict(dense_step_ms=round(1e3 * t_dense, 3), fast_step_ms=round(1e3 * t_fast, 3),
                slow_step_ms=round(1e3 * t_slow, 3), slow_vs_dense=round(t_slow / t_dense, 2),
                fast_speedup=round(t_dense / t_fast, 2))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--points", default="1x8192,1x32768,16x16384,8x32768",
                    help="BxC,... served by one engine per mode (they share max_num_seqs and max_model_len)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--mode", choices=sorted(MODES | SPEC_MODES), default=None, help="(internal) one engine")
    ap.add_argument("--slow-probe", action="store_true",
                    help="the SFI engine also runs each point with a slow step every other step; "
                    "from both runs the slow- and fast-step times follow (slow_step_ms, "
                    "slow_vs_dense, fast_speedup)")
    ap.add_argument("--probe-variants", action="store_true",
                    help="with --slow-probe, probe the --variant engines too (default: only the sfi engine)")
    ap.add_argument("--tag", default="", help="suffix of the output file name")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel workers per engine (GPUs)")
    ap.add_argument("--sfi", default=None,
                    help="JSON overrides of the SFI engine's settings "
                    "(e.g. '{\"side_stream\": false}' for an A/B run)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help="an extra SFI engine with these settings on top of --sfi's, run after the "
                    "others (repeatable); its figures are keyed NAME_* (NAME_ratio, NAME_slow_step_ms, ...)")
    ap.add_argument("--name", default=None, help="(internal) key prefix of a variant engine's results")
    ap.add_argument("--modes", default=None,
                    help="comma-separated engines to run (default: dense,sfi); the ratios need "
                    "dense and sfi in the same run")
    ap.add_argument("--spec", default=None, metavar="JSON",
                    help="speculative settings of the lossless and spec_dense engines, e.g. "
                    "'{\"num_speculative_tokens\": 4, \"synthetic_acceptance_length\": 4.5}'")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed runs of each point per engine and variant, one after the other on the same "
                    "engine (each a row of its own, field repeat; the ratios pair the runs of equal repeat)")
    ap.add_argument("--request-variant", action="append", default=[], metavar="NAME=JSON",
                    help="per-request SFI settings timed on the sfi engine after its own (repeatable; no "
                    "engine of their own: only policy fields); figures keyed NAME_* (NAME_ratio, ...)")
    ap.add_argument("--requests-on-variants", action="store_true",
                    help="run the --request-variant settings on the --variant engines too (figures keyed "
                    "VARIANT_REQUESTVARIANT_*, e.g. kern_stagger_ratio)")
    ap.add_argument("--itl", action="store_true",
                    help="step the engine in the timed runs and record each output's arrival: the rows get "
                    "the inter-token latencies (itl_p50_ms, itl_p99_ms, itl_max_ms, ...; generate_stepped)")
    ap.add_argument("--same-length", action="store_true",
                    help="every prompt of a point holds the point's context (default: row j's is j tokens shorter)")
    ap.add_argument("--make-model", action="store_true",
                    help="only write the checkpoint and its tokenizer (for serve_bench.sh) and exit")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)  # the engines' logs are written there first
    model = Path("/tmp/sfi-qwen3-4b-shape")
    if args.make_model:
        make_model(model)
        make_tokenizer(model)
        return 0
    points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
    if args.sfi:
        extra = json.loads(args.sfi)
        MODES["sfi"] = {**SFI, **extra}
    if args.spec:
        spec = json.loads(args.spec)
        for name, over in SPEC_MODES.items():
            if over is not None:  # the --sfi settings' experimental fields are kept
                over = {**over, "experimental": {**MODES["sfi"].get("experimental", {}), **over["experimental"]}}
            MODES[name] = None if over is None else {**MODES["sfi"], **over}
    if args.mode:
        spec = json.loads(args.spec) if args.mode in SPEC_MODES else None
        request_variants = _named_json(args.request_variant, "--request-variant") if args.mode == "sfi" else {}
        if args.name is not None:  # a variant engine: its request variants' figures under its own name
            request_variants = {f"{args.name}_{n}": over for n, over in request_variants.items()
                                if args.requests_on_variants}
        run(str(model), points, args.new_tokens, MODES[args.mode], args.name or args.mode,
            probe=args.slow_probe and MODES[args.mode] is not None and spec is None
            and (args.name is None or args.probe_variants),
            tp=args.tp, spec=spec, repeats=args.repeats, request_variants=request_variants, itl=args.itl,
            same_length=args.same_length)
        return 0
    variants = {name: {**json.loads(args.sfi or "{}"), **over}
                for name, over in _named_json(args.variant, "--variant").items()}
    request_variants = _named_json(args.request_variant, "--request-variant")
    if set(variants) & set(request_variants):
        raise SystemExit("--variant and --request-variant names must differ")
    combined = [f"{v}_{r}" for v in variants for r in request_variants] if args.requests_on_variants else []
    taken = set(variants) | set(request_variants) | {f"{v}_probe" for v in variants} | {"sfi_probe"}
    if set(combined) & taken or len(set(combined)) != len(combined):
        raise SystemExit(f"--requests-on-variants: the names {sorted(set(combined) & taken) or combined} collide "
                         "with other variants' figures; rename the variants")
    args.variants = list(variants) + list(request_variants) + combined
    import subprocess
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    make_model(model)
    modes = args.modes.split(",") if args.modes else ["dense", "sfi"]
    keys = [(*p, r) for p in points for r in range(1, args.repeats + 1)]
    timings = {p: attention_times(*p) for p in points}
    rows = {k: dict(batch=k[0], context=k[1], repeat=k[2], tp=args.tp, **timings[k[:2]]) for k in keys}
    for row in rows.values():
        if args.sfi:
            row["sfi_overrides"] = json.loads(args.sfi)
        if "sfi" in modes:
            row.update({f"{name}_overrides": over for name, over in request_variants.items()})
        row.update({f"{name}_engine_settings": over for name, over in variants.items()})
    for k in keys:
        print(json.dumps(rows[k]), flush=True)
    for mode in modes:
        if mode in SPEC_MODES and not args.spec:
            raise SystemExit(f"mode {mode!r} needs --spec (its speculative settings)")
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    for mode in modes + list(variants):
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        sfi_json = json.dumps(variants[mode]) if mode in variants else args.sfi
        cmd = [sys.executable, __file__, "--out", args.out, "--mode", "sfi" if mode in variants else mode,
               "--points", args.points, "--new-tokens", str(args.new_tokens)] + (
                   ["--sfi", sfi_json] if sfi_json else []) + (
                   ["--name", mode] if mode in variants else []) + (
                   ["--slow-probe"] if args.slow_probe else []) + (
                   ["--probe-variants"] if args.probe_variants else []) + ["--tp", str(args.tp)] + (
                   ["--spec", args.spec] if args.spec else []) + ["--repeats", str(args.repeats)] + (
                   ["--requests-on-variants"] if args.requests_on_variants else []) + (
                   ["--itl"] if args.itl else []) + (
                   ["--same-length"] if args.same_length else []) + [
                   a for v in (args.request_variant if mode == "sfi" or (mode in variants and args.requests_on_variants)
                               else []) for a in ("--request-variant", v)]
        # the engine's own log (captures, compilations, warnings) beside the results; its results
        # are written as they come, so that a run cut short keeps what it measured
        log_path = Path(args.out) / f"e2e-h200{args.tag}-{mode}.log"
        done = set()
        with open(log_path, "w") as log:
            # a session of its own: tensor-parallel workers are its children, killed with it below
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                    start_new_session=True)
            try:
                for line in proc.stdout:
                    log.write(line)
                    if not line.startswith("RESULT "):
                        continue
                    r = json.loads(line[7:])
                    done.add((r["batch"], r["context"], r["repeat"], r["mode"]))
                    row = rows[(r["batch"], r["context"], r["repeat"])]
                    name = r["mode"]
                    row[f"{name}_tok_s"] = r["decode_tok_s"]
                    row.update({f"{name}_{k}": v for k, v in r.items()
                                if k not in ("decode_tok_s", "batch", "context", "mode", "repeat")})
                    _write(args, keys, rows, quiet=True)
                proc.wait()
            finally:
                if proc.poll() is None:  # this process failed while reading: do not leave the engine running
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait()
        # every point and repeat of the engine's own settings, its request variants and its probe
        names = {mode}
        if mode == "sfi":
            names |= set(request_variants) | ({"sfi_probe"} if args.slow_probe else set())
        elif mode in variants:
            if args.slow_probe and args.probe_variants:
                names.add(f"{mode}_probe")
            if args.requests_on_variants:
                names |= {f"{mode}_{r}" for r in request_variants}
        missing = {(*k, n) for k in keys for n in names} - done
        if missing or proc.returncode != 0:
            err = log_path.read_text()[-3000:]
            what = (f"stopped early, without {len(missing)} of its results" if missing
                    else f"exited with rc {proc.returncode} after all its results")
            print(f"{mode} engine {what}:\n{err}", flush=True)
            for k in keys:
                rows[k].setdefault(f"{mode}_error", err[-600:])
        _write(args, keys, rows)
    return 0


def _named_json(values: list[str], flag: str) -> dict[str, dict]:
    """``NAME=JSON`` arguments -> {NAME: settings}; NAME a new identifier."""
    out = {}
    for v in values:
        name, _, text = v.partition("=")
        if (not name.isidentifier() or name in MODES or name in SPEC_MODES or name in out or name.endswith("_probe")
                or not text):
            raise SystemExit(f"{flag} wants NAME=JSON with a new identifier NAME (not ending in _probe), got {v!r}")
        out[name] = json.loads(text)
    return out


def _write(args, keys, rows, quiet: bool = False) -> None:
    out = []
    for key in keys:
        row = rows[key]
        if getattr(args, "same_length", False):
            row["same_length"] = True  # every prompt of the point at the point's context
        if "dense_tok_s" in row and "sfi_tok_s" in row:
            row["ratio"] = round(row["sfi_tok_s"] / row["dense_tok_s"], 2)
            row["slow_step_rate"] = row["sfi_slow_step_rate"]
            row["achievable_ratio"] = round(achievable_ratio(row), 2) if row.get("tp", 1) == 1 else None
            if "sfi_probe_tok_s" in row:
                row.update(step_times(row))
        for name in [*getattr(args, "variants", []), *SPEC_MODES]:
            if "dense_tok_s" in row and f"{name}_tok_s" in row:
                row[f"{name}_ratio"] = round(row[f"{name}_tok_s"] / row["dense_tok_s"], 2)
                if f"{name}_probe_tok_s" in row:
                    row.update({f"{name}_{k}": v for k, v in step_times(row, name).items() if k != "dense_step_ms"})
        out.append(row)
        if not quiet:
            print(json.dumps(row), flush=True)
    with open(Path(args.out) / f"e2e-h200{args.tag}.jsonl", "w") as f:
        for r in out:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
