"""Teacher forcing inside vLLM: a V1 logits processor that forces each request's next token and
records the model's own (raw) next-token distribution at every step.

Load it with ``LLM(..., logits_processors=[FORCE_PROCESSOR])`` and give a request

    SamplingParams(temperature=0, extra_args={"force": {"tokens": [...], "tag": "doc0/sfi/0.1",
                                                        "save_ref": "doc0" | "ref": "doc0"}})

At output step ``s`` (``s`` = tokens the request has produced so far; step 0 is predicted from the
prefill, steps >= 1 are decode steps) the processor

1. takes the row's logits as the model computed them: vLLM 0.27's sampler converts them to float32
   and runs the non-argmax-invariant processors (builtins first: min-tokens, logit-bias, which
   change nothing for a request that sets neither) before this one, so the row is the raw
   distribution (the same logits ``logprobs_mode="raw_logprobs"`` reports; tested);
2. records ``log_softmax`` over the full vocabulary: with ``save_ref`` it keeps the whole vector as
   the reference for step ``s``; with ``ref`` it stores, per step, the policy's argmax, the
   reference's argmax, KL(reference || policy) over the full vocabulary (float64), and the
   log-probability of the forced token under both;
3. sets every logit but ``tokens[s]`` to -inf, so a greedy request emits exactly ``tokens``.

Forced tokens travel through decode steps (the model's KV cache and the SFI controller see them as
sampled tokens), never through the prompt: prefill stays the prompt alone.

The records live in this module, in the process that runs the model: the engine must run in
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as :mod:`sfi_vllm.tools.engine_job` does);
:func:`collect` returns them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

FORCE_PROCESSOR = "sfi_vllm.tools.quality.forcing:ForceTokens"


@dataclass
class _Req:
    tokens: list[int]
    tag: str | None
    save_ref: str | None
    ref: str | None
    output: list[int]  # vLLM's running list of the request's output tokens (a reference)


@dataclass
class _Store:
    refs: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)  # ref -> step -> logp
    steps: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)  # tag -> step -> record
    pending: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)  # reference not seen yet
    tag_ref: dict[str, str] = field(default_factory=dict)
    applied: int = 0

    def clear(self) -> None:
        self.refs.clear()
        self.steps.clear()
        self.pending.clear()
        self.tag_ref.clear()
        self.applied = 0


STORE = _Store()


def compare(ref_logp: torch.Tensor, logp: torch.Tensor, forced: int | None) -> dict[str, Any]:
    """One step's record: argmaxes, KL(ref || policy) over the full vocabulary, forced-token logps."""
    r, p = ref_logp.double(), logp.double()
    kl = float(torch.sum(torch.exp(r) * (r - p)))
    rec = dict(top1=int(torch.argmax(p)), ref_top1=int(torch.argmax(r)), kl=max(kl, 0.0))
    if forced is not None:
        rec.update(forced_logp=float(p[forced]), ref_forced_logp=float(r[forced]))
    return rec


def _record(req: _Req, step: int, row: torch.Tensor) -> None:
    logp = torch.log_softmax(row.detach().float(), dim=-1).cpu()
    if req.save_ref is not None:
        STORE.refs.setdefault(req.save_ref, {})[step] = logp
    if req.tag is None:
        return
    forced = req.tokens[step] if step < len(req.tokens) else None
    if req.ref is None:
        rec = dict(top1=int(torch.argmax(logp)), forced_logp=None if forced is None else float(logp[forced]))
    else:
        STORE.tag_ref[req.tag] = req.ref
        ref = STORE.refs.get(req.ref, {}).get(step)
        if ref is None:  # its reference runs later (or in the same batch): compare in collect()
            STORE.pending.setdefault(req.tag, {})[step] = logp
            rec = {}
        else:
            STORE.pending.get(req.tag, {}).pop(step, None)
            rec = compare(ref, logp, forced)
    rec["forced"] = forced
    # A step can be seen twice (a chunked prefill's discarded partial rows, a preempted request's
    # recomputation); the last sighting is the one whose token was kept.
    STORE.steps.setdefault(req.tag, {})[step] = rec


class ForceTokens(LogitsProcessor):
    """Forces ``extra_args["force"]["tokens"]`` and records the raw distribution (module doc)."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        spec = (sampling_params.extra_args or {}).get("force")
        if spec is None:
            return
        if not isinstance(spec, dict):
            raise ValueError("extra_args['force'] must be a dict")
        toks = spec.get("tokens", [])
        if not isinstance(toks, list) or not all(isinstance(t, int) and t >= 0 for t in toks):
            raise ValueError("extra_args['force']['tokens'] must be a list of token ids")
        if spec.get("save_ref") is not None and spec.get("ref") is not None:
            raise ValueError("extra_args['force']: give save_ref or ref, not both")
        if sampling_params.temperature != 0:
            raise ValueError("teacher forcing needs greedy sampling (temperature=0)")

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, _Req] = {}
        self.vocab = vllm_config.model_config.get_vocab_size()

    def is_argmax_invariant(self) -> bool:
        return False

    @staticmethod
    def _new(params, _prompt, output) -> _Req | None:
        spec = (params.extra_args or {}).get("force")
        if spec is None:
            return None
        return _Req(tokens=list(spec.get("tokens", [])), tag=spec.get("tag"), save_ref=spec.get("save_ref"),
                    ref=spec.get("ref"), output=output)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, self._new)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for idx, req in self.rows.items():
            step = len(req.output)
            if req.tag is not None or req.save_ref is not None:
                _record(req, step, logits[idx])
            if step < len(req.tokens):
                tok = req.tokens[step]
                logits[idx].fill_(float("-inf"))
                logits[idx, tok] = 0.0
            STORE.applied += 1
        return logits


def collect(clear: bool = True) -> dict[str, Any]:
    """Every tag's per-step records (``{tag: [record for step 0, 1, ...]}``), comparing steps whose
    reference arrived after them; ``missing_ref`` lists steps that never got one."""
    missing = []
    for tag, steps in STORE.pending.items():
        ref = STORE.refs.get(STORE.tag_ref[tag], {})
        for step, logp in steps.items():
            if step in ref:
                forced = STORE.steps[tag][step]["forced"]
                STORE.steps[tag][step] = dict(compare(ref[step], logp, forced), forced=forced)
            else:
                missing.append((tag, step))
    out = dict(tags={tag: [steps[s] for s in sorted(steps)] for tag, steps in STORE.steps.items()},
               missing_ref=missing, applied=STORE.applied)
    for tag, steps in STORE.steps.items():
        if sorted(steps) != list(range(len(steps))):
            raise RuntimeError(f"teacher forcing: tag {tag} has steps {sorted(steps)} (not 0..n-1)")
    if clear:
        STORE.clear()
    return out
