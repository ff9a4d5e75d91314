"""vLLM general plugin (entry point ``vllm.general_plugins: sfi``), run in every vLLM process.

* registers the SFI backend for this platform under ``AttentionBackendEnum.CUSTOM`` (public API);
* adds ``SFI`` as an alias of ``CUSTOM`` in the enum's member map, so ``--attention-backend sfi``
  (parsed as ``AttentionBackendEnum[value.upper()]``) works; vLLM 0.26/0.27 have no public alias
  mechanism, and an alias to CUSTOM (value None, present in every process) survives pickling;
* installs the patches in :mod:`sfi_vllm.patches` (CPU backend choice, start-up config check,
  the front end's check of each request's SFI settings, the scheduler's common-prefix count);
* sends the ``sfi_vllm`` loggers' records to vLLM's log handlers (:func:`share_vllm_log_handlers`);
* prints an uncaught sfi-vllm start-up error (a bad SFI setting) as its message alone, without the
  traceback through vLLM's argument handling (:mod:`sfi_vllm.startup_errors`).

It must be idempotent and cheap, and must not initialise CUDA (vLLM would then switch to spawn).
vLLM only logs a plugin's exceptions, so an unsupported vLLM is reported here and again, as an
error, when an SFI engine is configured.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("sfi_vllm")

CPU_BACKEND = "sfi_vllm.backends.cpu.SFICpuBackend"
CUDA_BACKEND = "sfi_vllm.backends.cuda.SFIFlashBackend"
ALIAS = "SFI"


def backend_path_for(platform) -> str | None:
    if platform.is_cpu():
        return CPU_BACKEND
    if platform.is_cuda():
        return CUDA_BACKEND
    return None


def share_vllm_log_handlers() -> None:
    """Route the ``sfi_vllm`` loggers through the handlers and level vLLM gives its own ``vllm``
    logger. vLLM configures only that logger. Without this, our INFO records, such as the memory
    of the compact buffers logged at start-up, would reach Python's last-resort handler, which
    prints warnings and errors only, and a ``vllm serve`` log would have none of them. Nothing changes if the application configured ``sfi_vllm`` itself, or if vLLM's logging is
    off (``VLLM_CONFIGURE_LOGGING=0``: ``vllm`` has no handlers)."""
    ours, theirs = logging.getLogger("sfi_vllm"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


def register() -> None:
    from sfi_vllm.startup_errors import install_excepthook
    from sfi_vllm.version import UnsupportedVLLMVersion, require_supported_vllm

    share_vllm_log_handlers()
    install_excepthook()

    try:
        require_supported_vllm()
    except UnsupportedVLLMVersion as e:
        logger.error("%s The SFI backend is not registered.", e)
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    path = backend_path_for(current_platform)
    if path is None:
        logger.warning("sfi-vllm: no SFI backend for platform %s", type(current_platform).__name__)
        return
    register_backend(AttentionBackendEnum.CUSTOM, path)
    AttentionBackendEnum._member_map_.setdefault(ALIAS, AttentionBackendEnum.CUSTOM)

    from sfi_vllm.controller import on_new_controller
    from sfi_vllm.patches import config_check, prefix_count, request_check, runner_hooks

    config_check.install()
    request_check.install()
    prefix_count.install()  # acts in SFI engines only (it checks each engine's backend)
    # the per-step hooks on vLLM's model runner go in with the process's first SFI controller: a
    # process that never builds an SFI layer keeps vLLM's runner as it is
    on_new_controller(runner_hooks.install_for)
    if current_platform.is_cpu():
        from sfi_vllm.patches import cpu_platform

        cpu_platform.install()
