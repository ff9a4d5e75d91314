"""``sfi-vllm eval``: the offline suite through real vLLM, every policy in one engine.

All requests run in one engine with the SFI backend; each request carries its policy in
``SamplingParams.extra_args["sfi"]``. Dense requests run first (phase 0), so the other policies'
prompts hit vLLM's prefix cache and each prompt is prefilled once: prefill is dense for every
policy, so the cached KV is exactly what each policy would have computed.

Writes JSON lines, one object per policy x task x context x retention:
``policy, task, context, retention, score, n`` plus ``ci95`` (half-width, normal approximation),
``measured_retention`` (tokens attended per fast step / context, from the worker's statistics),
``slow_step_rate`` and ``agree_tokens`` (greedy tokens before the first divergence from dense on
the same sample).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import defaultdict
from typing import Any

from sfi_vllm.policies import POLICIES, policy_overrides


def run_eval(policies=POLICIES, retentions=(0.1, 0.2), contexts=(2048,), tasks=None, n=2, seed=0,
             out="quality.jsonl", raw_out: str | None = None, kv_cache_gib: int = 4,
             max_num_seqs: int = 8, engine_kwargs: dict | None = None) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    from sfi_vllm.engine_job import (CPU_DTYPE, EngineJob, common_prefix_len, cpu_engine_env,
                                     run_engine_job)
    from sfi_vllm.model_prep import prepare_model
    from sfi_vllm.quality.tasks import TASKS, make_suite, score

    tasks = tuple(tasks or TASKS)
    model = str(prepare_model(progress=False))
    tok = AutoTokenizer.from_pretrained(model)
    t0 = time.time()
    samples = make_suite(tok, tasks=tasks, contexts=tuple(contexts), n=n, seed=seed)
    print(f"suite: {len(samples)} samples ({len(tasks)} tasks x {len(contexts)} contexts x {n}) "
          f"in {time.time() - t0:.1f} s", flush=True)
    requests, keys = [], []
    for si, smp in enumerate(samples):
        requests.append(dict(prompt=smp.prompt, max_tokens=smp.max_new_tokens, sfi={"policy": "dense"}, phase=0))
        keys.append((si, "dense", None))
    for pol in policies:
        if pol == "dense":
            continue
        for r in retentions:
            for si, smp in enumerate(samples):
                requests.append(dict(prompt=smp.prompt, max_tokens=smp.max_new_tokens,
                                     sfi=policy_overrides(pol, r, smp.context_tokens), phase=1))
                keys.append((si, pol, r))
    print(f"running {len(requests)} requests in one vLLM engine ({len(samples)} prefills)", flush=True)
    eng = dict(max_model_len=max(contexts) if max(contexts) >= 8192 else max(contexts) + 512,
               max_num_seqs=max_num_seqs, enable_prefix_caching=True, dtype=CPU_DTYPE)
    eng.update(engine_kwargs or {})
    env = cpu_engine_env(kv_cache_gib)
    t0 = time.time()
    res = run_engine_job(EngineJob(model=model, requests=requests, attention_backend="sfi", sfi={},
                                   engine_kwargs=eng, progress=True), env=env, quiet=False)
    print(f"engine finished in {time.time() - t0:.0f} s (generate {res['generate_s']:.0f} s)", flush=True)

    outs = res["outputs"]
    dense_tokens = {si: outs[i]["token_ids"] for i, (si, pol, _) in enumerate(keys) if pol == "dense"}
    per = []
    for i, (si, pol, r) in enumerate(keys):
        smp, o = samples[si], outs[i]
        st = res["sfi_stats"].get(o["request_id"], {})
        per.append(dict(policy=pol, retention=r, task=smp.task, kind=smp.kind, context=smp.context_tokens,
                        index=smp.index, score=score(smp, o["text"]), output=o["text"],
                        answers=list(smp.answers), agree_tokens=common_prefix_len(dense_tokens[si], o["token_ids"]),
                        out_tokens=len(o["token_ids"]),
                        attended_fraction=st.get("attended_fraction"),
                        fast_steps=st.get("fast_steps", 0), slow_steps=st.get("slow_steps", 0),
                        decode_steps=st.get("decode_steps", 0), config_error=st.get("config_error")))
    errors = [p for p in per if p["config_error"]]
    if errors:
        raise RuntimeError(f"{len(errors)} requests had a bad SFI config: {errors[0]['config_error']}")
    if raw_out:
        with open(raw_out, "w") as f:
            for p in per:
                f.write(json.dumps(p) + "\n")
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for p in per:
        groups[(p["policy"], p["task"], p["context"], p["retention"])].append(p)
    rows = []
    for (pol, task, ctx, r), items in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], kv[0][3] or 1)):
        scores = [100 * p["score"] for p in items]
        fr = [p["attended_fraction"] for p in items if p["fast_steps"]]
        dec = sum(p["decode_steps"] for p in items)
        rows.append(dict(
            policy=pol, task=task, kind=items[0]["kind"], context=ctx, retention=1.0 if r is None else r,
            score=round(statistics.fmean(scores), 2), n=len(items),
            ci95=round(1.96 * statistics.stdev(scores) / math.sqrt(len(scores)), 2) if len(scores) > 1 else None,
            measured_retention=round(statistics.fmean(fr), 4) if fr else 1.0,
            slow_step_rate=round(sum(p["slow_steps"] for p in items) / dec, 4) if dec else None,
            agree_tokens=round(statistics.fmean(p["agree_tokens"] for p in items), 1)))
    with open(out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} rows to {out}")
    return rows
