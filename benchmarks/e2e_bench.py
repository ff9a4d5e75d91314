"""End-to-end decode throughput on the GPU, SFI vs dense, same run (vLLM 0.26, one H200).

    python3 benchmarks/e2e_bench.py --out DIR --points 1x32768,6x131072

Model: Qwen3-4B shape (36 layers, 32 q / 8 KV heads, head_dim 128, bf16) written as a safetensors
checkpoint with random normal weights (std 0.02, norms 1.0): not vLLM's dummy loader, whose
+-1e-3 weights make attention flat. Prompts are random token ids; decode is greedy with
ignore_eos. Decode throughput = generated tokens / (time of the generate call - time of the same
prefill alone). Writes e2e-h200.jsonl (batch, context, dense_tok_s, sfi_tok_s, ratio,
slow_step_rate) and prints it. The achievable ratio needs the kernel table of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
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


def run(model: str, batch: int, context: int, new_tokens: int, sfi: dict | None) -> dict:
    import torch
    from vllm import LLM, SamplingParams

    kw = dict(model=model, skip_tokenizer_init=True, max_model_len=context + new_tokens + 16,
              max_num_seqs=batch, enable_prefix_caching=False, gpu_memory_utilization=0.85,
              max_num_batched_tokens=16384, seed=0, enforce_eager=False)
    if sfi is not None:
        kw.update(attention_backend="sfi", additional_config={"sfi": sfi})
    llm = LLM(**kw)
    g = torch.Generator().manual_seed(batch * 7 + context)
    prompts = [{"prompt_token_ids": torch.randint(1000, 100000, (context,), generator=g).tolist()} for _ in range(batch)]
    pre = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    full = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    t = time.perf_counter(); llm.generate(prompts, pre, use_tqdm=False); t_pre = time.perf_counter() - t
    t = time.perf_counter(); llm.generate(prompts, full, use_tqdm=False); t_full = time.perf_counter() - t
    decode_tok = batch * (new_tokens - 1)
    res = dict(prefill_s=round(t_pre, 2), generate_s=round(t_full, 2),
               decode_tok_s=round(decode_tok / max(t_full - t_pre, 1e-6), 1))
    if sfi is not None:
        from sfi_vllm.controller import current_controller

        st = current_controller().stats.snapshot().values()
        slow = sum(s.slow_steps for s in st)
        dec = sum(s.decode_steps for s in st)
        res.update(slow_step_rate=round(slow / max(dec, 1), 4),
                   attended_fraction=round(sum(s.attended_fraction for s in st) / max(len(st), 1), 4))
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--points", default="1x32768")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--mode", choices=["dense", "sfi"], default=None, help="(internal) one engine")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--context", type=int)
    args = ap.parse_args()
    model = Path("/tmp/sfi-qwen3-4b-shape")
    sfi = {"preset": "balanced", "boundary_trigger": False}  # random tokens have no sentences: reuse budget 64
    if args.mode:
        r = run(str(model), args.batch, args.context, args.new_tokens, sfi if args.mode == "sfi" else None)
        print("RESULT " + json.dumps(r), flush=True)
        return 0
    import subprocess
    import sys

    make_model(model)
    rows = []
    for point in args.points.split(","):
        b, c = (int(x) for x in point.split("x"))
        row = dict(batch=b, context=c)
        for mode in ("dense", "sfi"):
            env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
            p = subprocess.run([sys.executable, __file__, "--out", args.out, "--mode", mode, "--batch", str(b),
                                "--context", str(c), "--new-tokens", str(args.new_tokens)],
                               capture_output=True, text=True, env=env, timeout=420)
            lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
            if not lines:
                row[f"{mode}_error"] = (p.stdout + p.stderr)[-2500:]
                print(row[f"{mode}_error"])
                continue
            r = json.loads(lines[0][7:])
            row[f"{mode}_tok_s"] = r["decode_tok_s"]
            row.update({f"{mode}_{k}": v for k, v in r.items() if k != "decode_tok_s"})
        if "dense_tok_s" in row and "sfi_tok_s" in row:
            row["ratio"] = round(row["sfi_tok_s"] / row["dense_tok_s"], 2)
            row["slow_step_rate"] = row.get("sfi_slow_step_rate")
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(Path(args.out) / "e2e-h200.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
