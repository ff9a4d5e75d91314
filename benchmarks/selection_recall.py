"""Where SFI's selection loses the needle: needle recall of each policy's selected set (CPU).

    python benchmarks/selection_recall.py --context 2048 --samples 10 --out recall.jsonl
    python benchmarks/selection_recall.py --task niah_single --context 2048 --samples 20
    python benchmarks/selection_recall.py --evidence prompt-tail --context 2048 --samples 20
    python benchmarks/selection_recall.py --context 8192 --retentions 0.03,0.06 --policies sfi --prefilter 2,4,8,16

For samples of a retrieval task of the quality suite (passkey by default), SmolLM2-135M-Instruct (transformers, float32, eager
attention) runs the chat prompt and its first greedy token, which is what vLLM's first decode step
(a slow step for every selecting policy) attends with. From that step's attention probabilities
and the cached keys, the reference Selector (:class:`sfi_vllm.selector.Selector`, the spec the GPU
kernels match) picks each policy's selected set per layer and KV head, at the policy's own working
set for each retention (:func:`sfi_vllm.tools.policies.policy_overrides`). Printed per policy and
retention: the share of the needle's tokens (every occurrence of every answer string in the
prompt, e.g. both occurrences of the pass key) that are selected, averaged over layers and KV heads; the share of (layer, head) sets holding every needle
token; and the evidence mass f on the needle. Samples whose needle lies in the recent window (kept
by every policy) are left out of the means and counted.

``--evidence prompt-tail`` takes the evidence instead from the attention of the last ``--tail``
prompt queries (16 by default), every query head of the group x every one of those rows pooled by
the Selector, with the Selector's several-rows lambda clip: how the authors' code bootstraps the
first selection during prefill (their "last 16" log-f capture), where our backend uses the first
decode step's query because vLLM's prefix caching skips the prompt's last queries.

``--prefilter m,...`` adds, per page-mode policy, the selection from candidate pages only
(``sfi.experimental.candidate_pages m``: per KV head the pages of highest Quest bound, from the
decode step's query, captured from the model's attention): printed with the share of the full
selection's tokens it keeps and the share of the context its candidate pages hold.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch

POLICIES = ("sfi", "sfi-no-follow", "sfi-nms", "sfi-no-prior", "sfi-paper", "sfi-paper-no-nms", "snapkv")


def needle_positions(tok: Any, text: str, keys: tuple[str, ...]) -> list[int]:
    """Token indices of ``text`` (as tokenised without special handling) overlapping any occurrence
    of any of ``keys``."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = []
    for key in keys:
        start = 0
        while (i := text.find(key, start)) >= 0:
            spans.append((i, i + len(key)))
            start = i + len(key)
    return [t for t, (a, b) in enumerate(enc["offset_mapping"]) if any(a < e and b > s for s, e in spans)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="passkey", help="a retrieval task of the suite")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--retentions", default="0.1,0.2")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--out", default=None, help="also write one JSON object per sample x policy x retention")
    ap.add_argument("--evidence", choices=("decode", "prompt-tail"), default="decode",
                    help="the first decode step's attention (as the backend does), or the last --tail prompt queries'")
    ap.add_argument("--tail", type=int, default=16, help="prompt queries pooled with --evidence prompt-tail")
    ap.add_argument("--prefilter", default="",
                    help="comma-separated multiples m: also run each page-mode policy with its candidates cut to "
                         "the pages of highest Quest bound, sfi.experimental.candidate_pages m "
                         "(sfi_vllm.selector.candidate_page_mask; policy name +pre<m>x); printed with the share "
                         "of the full selection it keeps and of the context its candidates hold")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sfi_vllm.compact import selected_count, window_start
    from sfi_vllm.config import build_config
    from sfi_vllm.tools.model_prep import prepare_model
    from sfi_vllm.tools.policies import policy_overrides
    from sfi_vllm.tools.quality.tasks import make_samples
    from sfi_vllm.selector import Selector, candidate_page_mask, quest_page_bounds

    torch.manual_seed(0)
    model_dir = prepare_model(progress=False)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    cfg_m = model.config
    hq, hkv = cfg_m.num_attention_heads, cfg_m.num_key_value_heads
    retentions = [float(x) for x in args.retentions.split(",")]
    policies = args.policies.split(",")
    multiples = [float(x) for x in args.prefilter.split(",") if x]
    queries: list[torch.Tensor] = []  # the decode step's post-RoPE query per layer, (Hq, D)
    if multiples:
        import transformers.models.llama.modeling_llama as llama

        eager = llama.eager_attention_forward

        def capture(module, query, *a, **kw):
            if query.shape[2] == 1:
                queries.append(query[0, :, 0].float())
            return eager(module, query, *a, **kw)

        llama.eager_attention_forward = capture
    rows: list[dict] = []
    full_sets: dict = {}  # (sample, retention, policy, layer) -> the full selection, for +pre variants
    for smp in make_samples(tok, args.task, args.context, args.samples):
        text = tok.apply_chat_template([{"role": "user", "content": smp.prompt}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        needle = needle_positions(tok, text, smp.answers)
        tail = args.tail if args.evidence == "prompt-tail" else 0
        with torch.no_grad():
            if tail:  # the prompt in two parts, so that only the tail's attention is materialised
                head = model(ids[:, :-tail], use_cache=True)
                out = model(ids[:, -tail:], past_key_values=head.past_key_values, use_cache=True,
                            output_attentions=True)
            else:
                out = model(ids, use_cache=True)
            first = out.logits[0, -1].argmax().view(1, 1)
            queries.clear()
            step = model(first, past_key_values=out.past_key_values, use_cache=True, output_attentions=True)
        ctx = ids.shape[1] + 1
        cache = step.past_key_values
        if tail:  # (Hq, T, L) per layer -> (Hkv, G x T, ctx): the new token's column is 0
            evidence = [torch.nn.functional.pad(a[0], (0, 1)).view(hkv, (hq // hkv) * tail, ctx)
                        for a in out.attentions]
        else:
            evidence = [a[0, :, 0, :].view(hkv, hq // hkv, ctx) for a in step.attentions]
        rows_pooled = max(1, tail)
        for r in retentions:
            for pol, mult in [(pol, m) for pol in policies for m in [None, *multiples]]:
                cfg = build_config({"boundary_token_ids": [0], **policy_overrides(pol, r, ctx)}, use_env=False)
                if mult is not None and (cfg.selector.page_size <= 1 or tail):
                    continue  # page-mode policies, decode evidence only
                name = pol if mult is None else f"{pol}+pre{mult:g}x"
                ws, sinks, k = window_start(cfg, ctx), min(cfg.sinks, ctx), selected_count(cfg, ctx)
                cand = [p for p in needle if sinks <= p < ws]
                sel = Selector(cfg.selector)
                recall, full, mass, kept, shares = [], [], [], [], []
                for layer, probs in enumerate(evidence):  # (Hkv, rows, ctx)
                    keys = cache.layers[layer].keys[0] if hasattr(cache, "layers") else cache[layer][0][0]
                    norms = keys[:, sinks:ws].float().norm(dim=-1)  # (Hkv, C)
                    f = sel.evidence(probs, sinks, ws)
                    if not 0 < k < ws - sinks:
                        chosen = torch.arange(sinks, sinks + k).expand(hkv, k)
                    elif mult is None:
                        chosen = sel.select(probs, norms, sinks, ws, k, rows_pooled)
                        full_sets[(smp.index, r, pol, layer)] = chosen
                    else:
                        bounds = quest_page_bounds(queries[layer], keys, sinks, ws, cfg.selector.page_size,
                                                   keys.shape[-1] ** -0.5)
                        mask = candidate_page_mask(bounds, k, mult, cfg.selector)
                        chosen = sel.select(probs, norms, sinks, ws, k, rows_pooled, candidates=mask)
                        share = float(mask.repeat_interleave(cfg.selector.page_size, 1)[:, :ws - sinks].float().mean())
                        ref = full_sets[(smp.index, r, pol, layer)]
                        shares.append(share)
                        kept += [len(set(chosen[h].tolist()) & set(ref[h].tolist())) / max(1, ref.shape[1])
                                 for h in range(hkv)]
                    for h in range(hkv) if cand else ():
                        got = set(chosen[h].tolist())
                        hit = sum(p in got for p in cand)
                        recall.append(hit / len(cand))
                        full.append(hit == len(cand))
                        mass.append(float(f[h, [p - sinks for p in cand]].sum()))
                if not cand:  # the needle is in the window (or the sinks): every policy keeps it
                    rows.append(dict(index=smp.index, policy=name, retention=r, context=ctx, selected=k,
                                     window_start=ws, needle_tokens=len(needle), needle_candidates=0,
                                     evidence=args.evidence, tail=tail))
                    continue
                rows.append(dict(index=smp.index, policy=name, retention=r, context=ctx, selected=k,
                                 window_start=ws, needle_tokens=len(needle), needle_candidates=len(cand),
                                 recall=statistics.fmean(recall), all_needle=statistics.fmean(full),
                                 needle_evidence=statistics.fmean(mass), evidence=args.evidence, tail=tail,
                                 **({"kept_of_full": statistics.fmean(kept), "candidate_share": statistics.fmean(shares)}
                                    if kept else {})))
        print(f"sample {smp.index}: {len(needle)} needle tokens, {len(cand)} among the candidates", flush=True)
    source = f"the last {tail} prompt queries" if tail else "the first decode step"
    print(f"\n{args.task}, {args.context}-token suite, {args.samples} samples, evidence from {source}; mean over "
          f"samples of the mean over {len(step.attentions)} layers x {hkv} KV heads")
    print("| policy | retention | needle recall | sets with the whole needle | evidence mass on needle | samples "
          "| share of the full selection kept | candidates (share of the context before the window) |")
    print("|---|---|---|---|---|---|---|---|")
    names = list(dict.fromkeys(x["policy"] for x in rows))
    for r in retentions:
        for pol in names:
            sub = [x for x in rows if x["policy"] == pol and x["retention"] == r and x["needle_candidates"]]
            skipped = sum(1 for x in rows if x["policy"] == pol and x["retention"] == r and not x["needle_candidates"])
            if not sub:
                continue
            print(f"| {pol} | {r:.2f} | {100 * statistics.fmean(x['recall'] for x in sub):.1f}% | "
                  f"{100 * statistics.fmean(x['all_needle'] for x in sub):.1f}% | "
                  f"{statistics.fmean(x['needle_evidence'] for x in sub):.4f} | {len(sub)} ({skipped} in the window) | "
                  + (f"{100 * statistics.fmean(x['kept_of_full'] for x in sub):.1f}% | "
                     f"{100 * statistics.fmean(x['candidate_share'] for x in sub):.1f}% |" if all("kept_of_full" in x for x in sub)
                     else "- | - |"))
    if args.out:
        with open(args.out, "w") as fh:
            for x in rows:
                fh.write(json.dumps(x) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
