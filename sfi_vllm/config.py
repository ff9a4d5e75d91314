"""SFIConfig: the one validated configuration object for every SFI knob, in two halves.

* :class:`EngineSettings`: what the engine fixes when it starts (the mode, the boundary trigger's
  vocabulary, kernels, streams, CUDA graphs, buffer sizes, the statistics file);
* :class:`Policy`: what one request may set (the policy, its working set, triggers, Selector).

``SFIConfig`` inherits both, so every module reads one object with flat fields (``cfg.kernels``,
``cfg.selected_tokens``) and the checks that span the halves live on it. An engine's config is
built by :func:`build_config`; a request's is :func:`merge_policy` of its Policy fields over the
engine's config, which keeps the engine's EngineSettings.

Sources of an engine's config, later ones overriding earlier ones field by field:
  1. the preset named by ``preset`` (``configs/<name>.yaml``: balanced, speed, paper);
  2. a YAML file named by the environment variable ``SFI_CONFIG``;
  3. the ``sfi`` key of vLLM's ``--additional-config`` (or ``LLM(additional_config=...)``).

docs/selection.md says how the default selection works; the README lists every field.
A bad value raises :class:`SFIConfigError` naming the field and the allowed range.
"""

from __future__ import annotations

import os
import reprlib
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import numpy as np
import yaml
from pydantic import (BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError, ValidationInfo, field_validator,
                      model_validator)

PRESET_DIR = Path(__file__).resolve().parent / "presets"
PRESETS = ("balanced", "speed", "paper")
# presets that were removed, with what to set instead
REMOVED_PRESETS = {
    "quality": 'it was the default with a 32-step dense bridge, whose quality measured level with the '
               'default\'s and whose speed was never measured; set "bridge_steps": 32 instead',
}
ENV_CONFIG_FILE = "SFI_CONFIG"
ADDITIONAL_CONFIG_KEY = "sfi"
# fused_scores_tokens "auto": the most the fused score buffers may take, in bytes and as a share of
# the GPU's memory (so that a small GPU does not give a twelfth of itself to them; 2 GiB is 1.4% of
# an H200). At 327,680 tokens (1.76 GiB for Qwen3-4B) the fused scores raised decode throughput
# by 3.7% at 16 x 16K and 3.5% at 8 x 32K over the second pass (benchmarks/results/e2e-h200.md).
FUSED_AUTO_BYTES = 2 << 30
FUSED_AUTO_FRACTION = 0.02


class SFIConfigError(ValueError):
    """A bad SFI setting; the message names the field and the allowed range."""


def _refuse_moved(data: Any, moved: dict[str, str], old_prefix: str, new_prefix: str) -> Any:
    """A validator's input, unless it holds a key that moved: then an error naming its new place."""
    if isinstance(data, dict):
        for old, new in moved.items():
            if old in data:
                raise ValueError(f"{old_prefix}{old} moved to {new_prefix}{new}")
    return data


def _takes_numbers(annotation: Any) -> bool:
    """Whether a field takes numbers: one of its annotation's types (``int``, ``float | None``,
    ``Literal["auto"] | int``, ``list[int] | None``) is int or float, and none is bool."""
    members = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    members = [get_args(m)[0] if get_origin(m) in (list, Annotated) else m for m in members]
    return any(m in (int, float) for m in members) and bool not in members


def _refuse_bool_number(model: type[BaseModel], value: Any, info: ValidationInfo) -> Any:
    """A field validator's input, unless it is a boolean (or a list holding one) for a number field:
    pydantic's lax mode would read ``true`` as 1, and a boolean where a count is expected is a
    mistake, not a count; likewise a string with an underscore (lax mode reads ``"1_0"`` as 10)."""
    field = model.model_fields.get(info.field_name or "")
    if field is None or not _takes_numbers(field.annotation):
        return value
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"expects a number, not the boolean {value!r}")
    if isinstance(value, (list, tuple)) and any(isinstance(v, (bool, np.bool_)) for v in value):
        raise ValueError("expects a list of numbers, and this one holds a boolean")
    if isinstance(value, str) and "_" in value:  # lax mode would read Python's digit separators: "1_0" as 10
        raise ValueError(f"expects a number, not the string {echo(value)} (digit separators are not read)")
    return value


class _StrictNumbers(BaseModel):
    """Frozen, unknown keys refused, no NaN or infinity, no boolean where a number is expected."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_bool_number(cls, value, info)


class ExperimentalConfig(_StrictNumbers):
    """Options kept for comparison runs: measured, not better than the default where it matters."""

    @model_validator(mode="before")
    @classmethod
    def _promoted_fields(cls, data: Any) -> Any:
        return _refuse_moved(data, PROMOTED_FIELDS, "sfi.experimental.", "sfi.")

    selector_top_k: Literal["auto", "torch", "triton"] = Field(
        "auto",
        description=(
            "GPU kernel path: the top-K after the fused Selector. auto: page selection by one Triton "
            "launch (page sizes that are powers of two up to 32; others take torch's), token-level "
            "selection by torch.topk; torch: torch's for both (the reference); triton: Triton kernels for "
            "both (the token-level one is slower than torch's except at narrow frames). The Triton "
            "kernels give ties to the lower position or page (docs/settings.md)"
        ),
    )
    keys_only_scores: Literal["refresh", "fast_kernel"] = Field(
        "refresh",
        description=(
            "GPU kernel path, keys-only slow rows inside a CUDA graph with fused score buffers: who "
            "scores their keys. refresh: the score kernel, in the refresh after the step; fast_kernel: "
            "the fast-step kernel, after each row's attention (about half the GPU's bandwidth there; "
            "docs/settings.md)"
        ),
    )
    candidate_pages: float = Field(
        0.0, ge=0.0, le=1024.0,
        description=(
            "the torch reference path only (the GPU kernels refuse it), page selection "
            "(selector.page_size > 1): a re-selection scores only the max(this x ceil(K / page), ceil(K / "
            "page) + 1) pages per KV head with the highest Quest bound (the page's key min/max against "
            "the group's queries, spread over follow_pages); the evidence and the prior are normalised "
            "over them. It measures what a re-selection that read only the page bounds and those pages' "
            "keys would keep; the reference itself reads every key (docs/selection.md). 0: every page"
        ),
    )
    prompt_window: int = Field(
        0, ge=0, le=1024,
        description=(
            "the torch reference path only (the GPU kernels refuse it), lossy mode: a request's first "
            "selection also pools the attention of its prompt's last this many query tokens (SnapKV's "
            "observation window), kept from its prefill, with the first selection's own query. The "
            "scheduler then leaves at least this many prompt tokens out of a prefix-cache hit, so that "
            "their queries are computed (docs/selection.md). 0: the first selection's query alone"
        ),
    )
    wide_dense_tiles: bool = Field(
        False,
        description=(
            "GPU kernel path, uniform decode launches (one token per row) of at most 8 rows, CUDA-graph "
            "padding included: the dense rows of at least 64K keys that write no scores (bridge steps, "
            "dense slow rows) read their keys 64 at a time instead of 32. In the kernel alone on the "
            "H200 that takes 13-14% off such rows at 128K (level with FlashAttention-3 at 1 x 128K); end "
            "to end on an H100 at 1 x 128K it took 0.1 ms off the ITL p99 and 4-8% off the throughput "
            "(docs/settings.md)"
        ),
    )
    flash_dense_steps: bool = Field(
        False,
        description=(
            "GPU kernel path, lossy mode: a decode step whose every row attends densely (none fast, slow "
            "or prefilling: the dense bridge, dense_below_context, policy dense, pool-full fallbacks) runs "
            "FlashAttention over all its rows outside the CUDA graph (vLLM's piecewise graphs), instead of "
            "the fast-step kernel's dense rows in a full graph. On the H200 the kernel's dense rows take 8-15% "
            "longer than FlashAttention-3 at 16 x 16K, 8 x 32K and 1 x 128K, and FlashAttention-3 21% longer "
            "at 6 x 128K; the step costs more host time "
            "(docs/settings.md)"
        ),
    )
    one_wave_splits: bool = Field(
        False,
        description=(
            "GPU kernel path, uniform decode launches (one token per row): the fast-step kernel takes "
            "the largest split count whose programs (rows x KV heads x splits) fit in one wave of 528 "
            "(132 SMs x 4) instead of the smallest that reaches 528 (e.g. 8 splits instead of 9 at 8 "
            "rows of 8 KV heads, 4 instead of 5 at 16 rows), so that on a 132-SM GPU no program waits for a "
            "second wave. In the kernel alone on an H100 it was slower than the smallest count at 16 x 16K "
            "and 8 x 32K and at most 0.5 us faster at 4 x 32K (benchmarks/splits_bench.py; docs/settings.md). "
            "Needs balanced_splits false"
        ),
    )
    synthetic_acceptance: bool = Field(
        False,
        description="sfi.mode lossless, for speed measurements only: allow vLLM's "
        "rejection_sample_method 'synthetic', which accepts drafts at a set rate "
        "(synthetic_acceptance_length) instead of verifying them, so that a model with random "
        "weights runs at the acceptance measured on a real one. The output is not the model's",
    )


# top-level fields that moved into a nested model: their new place
MOVED_FIELDS = {"selector_top_k": "experimental.selector_top_k"}
# experimental fields that became settings: their new place
PROMOTED_FIELDS = {"drafter_graphs": "drafter_graphs", "balanced_splits": "balanced_splits"}


class SelectorConfig(_StrictNumbers):
    """Constants of the Selector (evidence pooling, prior, fusion, soft-NMS, exclusivity)."""

    alpha: float = Field(0.5, gt=0.0, le=4.0, description="power-mean exponent pooling the GQA group")
    use_prior: bool = Field(True, description="fuse the key-norm/position prior with the evidence")
    gamma: float = Field(0.5, ge=0.0, le=4.0, description="key-norm damping exponent")
    w_norm: float = Field(1.0, ge=0.0, le=10.0, description="weight of the key-norm term")
    w_pos: float = Field(0.7, ge=0.0, le=10.0, description="weight of the position term")
    pos_power: float = Field(1.8, gt=0.0, le=10.0, description="p in -beta*u^p")
    eta: float = Field(0.4, ge=0.0, le=10.0, description="weight of log(1-u)")
    beta: float = Field(0.5676, ge=0.0, le=10.0, description="-ln(0.6)/0.9")
    lambda_max_single: float = Field(0.35, ge=0.0, le=1.0, description="lambda clip, one query row")
    lambda_max_multi: float = Field(0.25, ge=0.0, le=1.0, description="lambda clip, several rows")
    use_nms: bool = Field(
        False, description="soft non-maximum suppression along positions (pages in page mode); the "
        "paper's step, off by default: on SmolLM2 it pushed the rest of a multi-token answer out of the set")
    nms_radius: int = Field(16, ge=1, le=1024, description="soft-NMS half window in tokens")
    nms_strength: float = Field(1.0, ge=0.0, le=10.0, description="a: log-gap penalty factor")
    use_exclusivity: bool = Field(True, description="cross-head exclusivity (needs > 2 KV heads)")
    exclusivity_temperature: float = Field(2.0, gt=0.0, le=100.0, description="T")
    exclusivity_strength: float = Field(0.85, ge=0.0, le=10.0, description="c")
    smooth_kernel: int = Field(
        0, ge=0, le=257, description="average-pool the evidence over this many positions (SnapKV-style; 0: off)"
    )
    page_size: int = Field(
        16, ge=0, le=256,
        description="select whole pages of this many candidates ranked by their fused mass (soft-NMS, "
        "exclusivity and follow_pages then act on pages; 0 or 1: token by token, the paper's)",
    )
    follow_pages: int = Field(
        2, ge=0, le=64,
        description="page mode: a page also takes the score of each of this many pages before it, less "
        "follow_penalty per page of distance, so the text after a strong page (the rest of a number, "
        "a passage being copied) is selected with it; 0: off (the paper's)",
    )
    follow_penalty: float = Field(
        1.0, ge=0.0, le=80.0, description="log-score a followed page loses per page of distance")


class _SettingsModel(_StrictNumbers):
    """What :class:`Policy`, :class:`EngineSettings` and :class:`SFIConfig` share: frozen, unknown
    keys refused (and NaN, infinity and booleans for numbers), a field of the other half named as
    such, a moved field named with its new place."""

    @model_validator(mode="before")
    @classmethod
    def _moved_fields(cls, data: Any) -> Any:
        return _refuse_moved(data, MOVED_FIELDS, "sfi.", "sfi.")

    @model_validator(mode="before")
    @classmethod
    def _other_half(cls, data: Any) -> Any:
        # SFIConfig holds both halves, so this refuses nothing there
        if isinstance(data, dict):
            for key in data:
                if key in cls.model_fields:
                    continue
                if key in EngineSettings.model_fields:
                    raise ValueError(f"sfi.{key} is an engine-wide setting (EngineSettings), fixed when the "
                                     "engine starts; a request's Policy cannot set it")
                if key in Policy.model_fields:
                    raise ValueError(f"sfi.{key} is a per-request setting (Policy), not an EngineSettings field")
        return data


class Policy(_SettingsModel):
    """What one request may set: the policy, its working set, its slow-step triggers and its
    Selector. The engine's values are every request's defaults."""

    preset: Literal["balanced", "speed", "paper"] | None = Field(
        None, description="start from this preset (configs/<name>.yaml) instead of the defaults; fields given "
        "beside it override it. A request naming one runs the preset's policy, not the engine's"
    )
    policy: Literal["sfi", "dense", "streaming", "snapkv", "quest"] = Field(
        "sfi",
        description="sfi; or a baseline in the same backend: dense, streaming (sinks + sliding "
        "window), snapkv (select once at the first decode step, never refresh), quest (per-step "
        "page selection from per-page key min/max; on the GPU a step with a quest row runs eagerly, "
        "outside the full CUDA graph, for the whole batch)",
    )

    # Working set of a fast step.
    sinks: int = Field(4, ge=0, le=4096, description="first tokens always kept")
    recent_window: int = Field(256, ge=1, le=1 << 20, description="last tokens read in place")
    window_align: int = Field(
        16, ge=1, le=4096, description="the window's start is aligned down to this many tokens"
    )
    window_mode: Literal["grow", "slide"] = Field(
        "grow",
        description="grow: the window starts where it did at the last slow step and takes in new "
        "tokens; slide: it is the last recent_window tokens at every step",
    )
    quest_page: int = Field(16, ge=1, le=4096,
                            description="page size of the quest policy; at most K (K is taken in whole pages; with "
                            "selected_fraction, at most the K it gives at max_model_len, and at contexts where "
                            "K is below a page nothing is selected)")
    selected_tokens: int | None = Field(
        None, ge=0, le=1 << 20, description="selected long-range tokens per KV head (fixed K)"
    )
    selected_fraction: float | None = Field(
        None, gt=0.0, le=1.0, description="K as a fraction of the context (replaces selected_tokens)"
    )
    selected_floor: int = Field(64, ge=0, le=1 << 20, description="lower bound on K (fraction mode)")
    selected_cap: int = Field(8192, ge=1, le=1 << 20, description="upper bound on K (fraction mode)")

    # Slow-step triggers.
    boundary_trigger: bool = Field(True, description="slow step at sentence boundaries")
    boundary_fire: Literal["next_token", "at_ender"] = Field(
        "next_token",
        description="fire on the first token after the ender (authors) or on the ender itself",
    )
    reuse_budget: int = Field(64, ge=1, le=1 << 20, description="max fast steps between slow steps")
    bridge_steps: int = Field(
        16, ge=0, le=1 << 20,
        description="the first decode steps after a prefill that come before the first selection (the "
        "bridge; they attend densely unless bridge_attention is selected): a request's first tokens often restate the question before the "
        "answer, and a set chosen from the first decode query misses what the answer reads; 0: select "
        "at the first decode step (the paper's). Policy sfi only: snapkv selects at the first decode step",
    )
    bridge_attention: Literal["dense", "selected"] = Field(
        "dense",
        description="what the bridge's steps attend to. dense: the whole context, each a dense decode step; "
        "selected: a provisional set chosen at the first decode step (a slow step that attends densely), "
        "as fast steps do (a sentence end or the reuse budget may re-select it, keys-only), and the bridge "
        "ends with a slow step that attends densely and makes the first selection as the dense bridge's end "
        "does (statistics: slow reason bridge_end). Of the dense bridge's steps one becomes a slow step and the "
        "others fast steps; the bridge's tokens are then not dense's (docs/selection.md)",
    )
    reuse_stagger: bool = Field(
        True,
        description=(
            "spread the reuse-budget phase over requests: the first reuse interval after a request's "
            "first selection is shortened by an offset in [0, reuse_budget) drawn from its context length "
            "and prompt tokens, so that requests that start together do not all re-select on the same "
            "step (statistics: reuse_offset). false: they re-select together (docs/settings.md)"
        ),
    )
    min_gap: int = Field(16, ge=0, le=1 << 20,
                         description="boundary trigger: a sentence end fires a slow step only after this many fast "
                         "steps since the last slow step (the reuse budget fires regardless, and reuse_stagger "
                         "may shorten the interval after a first selection below it). In the lossy mode at most "
                         "reuse_budget: a request that sets reuse_budget below the engine's min_gap must set "
                         "min_gap too")
    dense_below_context: int = Field(
        0, ge=0, le=1 << 24, description="contexts shorter than this decode densely (lossy mode: a request whose "
        "prompt plus max_tokens is at most this takes no compact set)"
    )
    layer_interleaved_refresh: bool = Field(
        False, description="a slow step refreshes half of the layers (odd/even alternating)"
    )
    slow_attention: Literal["keys", "dense"] = Field(
        "keys",
        description=(
            "what a slow step's own token attends to. keys: the working set it already has, as a fast "
            "step does, while the step reads the keys alone to choose the next set (no values); dense: "
            "the whole context (the paper's). A first selection after a prefill attends densely either "
            "way. In sfi.mode lossless: the drafter's re-selecting first pass (docs/settings.md, "
            "docs/lossless.md)"
        ),
    )
    draft_reselect: Literal["verify", "reuse_budget", "rejection"] = Field(
        "verify",
        description=(
            "sfi.mode lossless: when the drafter re-selects. verify: at every verify step; reuse_budget: "
            "once reuse_budget tokens have been verified since its last selection (the first passes in "
            "between are fast steps); rejection: after a verify step that rejected a draft, and at the "
            "reuse budget (docs/lossless.md)"
        ),
    )

    # Selection.
    selector: SelectorConfig = Field(default_factory=SelectorConfig)

    @model_validator(mode="before")
    @classmethod
    def _default_budget(cls, data: Any) -> Any:
        # K defaults to 2048 tokens unless a fraction is given.
        if isinstance(data, dict) and data.get("selected_tokens") is None and data.get(
            "selected_fraction"
        ) is None:
            data = {**data, "selected_tokens": 2048}
        return data

    @model_validator(mode="after")
    def _policy_checks(self) -> "Policy":
        if self.selected_tokens is not None and self.selected_fraction is not None:
            raise ValueError("give selected_tokens or selected_fraction, not both")
        if self.selected_floor > self.selected_cap:
            raise ValueError(
                f"selected_floor ({self.selected_floor}) must be <= selected_cap ({self.selected_cap})"
            )
        if self.policy == "quest":
            # K holds whole pages: a page larger than the largest K would leave the policy with
            # nothing to select (sinks and window alone) at every context (quest_page_problem: the
            # largest K within the engine's max_model_len)
            most = (("selected_tokens", self.selected_tokens) if self.selected_tokens is not None
                    else ("selected_cap", self.selected_cap))
            if self.quest_page > most[1]:
                raise ValueError(f"quest_page ({self.quest_page}) must be <= {most[0]} ({most[1]}) under "
                                 "policy quest: K is taken in whole pages, and no page of that size fits")
        return self

    @property
    def refreshes_selection(self) -> bool:
        """Slow steps after the first: only SFI re-selects (snapkv selects once, streaming never)."""
        return self.policy == "sfi"

    @property
    def slides_window(self) -> bool:
        return self.window_mode == "slide" or self.policy == "streaming"

    def selected_budget(self, context_len: int) -> int:
        """K for a context of ``context_len`` tokens (before clipping to the candidates)."""
        if self.policy == "streaming":
            return 0
        if self.selected_fraction is None:
            assert self.selected_tokens is not None
            return self.selected_tokens
        k = round(self.selected_fraction * context_len)
        return max(self.selected_floor, min(self.selected_cap, k))

    def quest_page_problem(self, max_context_len: int | None) -> str | None:
        """Why ``quest_page`` selects nothing at any context up to ``max_context_len`` (the largest
        K a fraction gives there is smaller than a page), or None."""
        if self.policy != "quest" or self.selected_fraction is None or not max_context_len:
            return None
        most = self.selected_budget(max_context_len)
        if self.quest_page <= most:
            return None
        return (f"quest_page ({self.quest_page}) must be <= {most}, the largest K that selected_fraction "
                f"{self.selected_fraction} gives within max_model_len {max_context_len} (selected_floor "
                f"{self.selected_floor}, selected_cap {self.selected_cap}): K is taken in whole pages, and no page "
                "of that size fits at any context; raise selected_fraction or selected_floor, or take smaller pages")

    def compact_capacity(self, max_context_len: int) -> int:
        """Tokens a compact set can hold: sinks + the largest K a context up to ``max_context_len``
        gets (for sizing preallocated buffers)."""
        return self.sinks + min(self.selected_budget(max_context_len), max_context_len)


class EngineSettings(_SettingsModel):
    """What the engine fixes when it starts: the mode, the boundary trigger's vocabulary, the
    kernels, streams, CUDA graphs and buffers, the statistics file. They size buffers, pick kernels
    and graphs or build the trigger's vocabulary, so no request may change them."""

    mode: Literal["lossy", "lossless"] = Field(
        "lossy",
        description=(
            "lossy: decode steps attend to the working set (or densely) and the output is what they "
            "sample. lossless: SFI attends only in a drafter, the same checkpoint under vLLM's "
            "draft_model speculative decoding (--speculative-config), whose tokens the model verifies "
            "with dense attention: greedy output is dense's (in bf16, that of speculative decoding with "
            "an exact drafter), sampled output follows dense's distribution (docs/lossless.md)"
        ),
    )

    # The boundary trigger's vocabulary and how it reads the sampled tokens.
    newline_is_boundary: bool = Field(True, description="newline tokens end a sentence too (with the "
                                      "tokenizer's enders; explicit boundary_token_ids replace both)")
    boundary_token_ids: list[int] | None = Field(
        None, description="explicit sentence-ender token ids, at least one (default: derived from the "
        "tokenizer, with newlines as newline_is_boundary says); they replace the derived set, newlines included"
    )
    @field_validator("boundary_token_ids")
    @classmethod
    def _token_ids_not_negative(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and not ids:
            raise ValueError("an empty list would leave the boundary trigger nothing to fire on; give at "
                             "least one id, or set boundary_trigger false")
        if ids is not None and any(i < 0 for i in ids):
            raise ValueError("token ids are 0 or more")
        return ids

    boundary_read: Literal["auto", "exact", "lagged"] = Field(
        "auto",
        description=(
            "how the boundary trigger learns the sampled tokens. exact: read to the host when a decision "
            "needs it (on a GPU a sync with the previous step); lagged: copied to the host "
            "asynchronously, the trigger seeing each token one step later (a boundary slow step fires a "
            "token later, no step waits); auto: lagged on a GPU, exact on the CPU"
        ),
    )

    # GPU kernel path: kernels, streams, CUDA graphs, buffers.
    kernels: Literal["auto", "triton", "torch"] = Field(
        "auto", description="GPU fast path: triton kernels (auto on CUDA; triton without CUDA is refused at start-up) or the torch reference"
    )
    side_stream: bool = Field(
        True,
        description="GPU kernel path: run the slow step's selection and repack on a second CUDA "
        "stream (the per-layer refresh beside the next layers, the per-step refresh beside the "
        "step's tail and, with refresh_overlap, the next step; compact sets double-buffered, twice "
        "the memory)",
    )
    refresh_overlap: bool = Field(
        False,
        description=(
            "GPU kernel path, lossy mode, needs side_stream: the next step decodes while a slow step's "
            "per-step refresh is still running, a re-selected row attending through its previous set for "
            "one more step; steps that cannot run beside the refresh still wait. Off by default: -12% to "
            "+8% throughput against waiting on the H200 (docs/settings.md)"
        ),
    )
    slow_refresh: Literal["auto", "per_layer", "per_step"] = Field(
        "auto",
        description="GPU kernel path: a slow step re-selects each layer right after its "
        "attention (per_layer), or every layer at once after the step's last layer, replayed from "
        "one CUDA graph per shape (per_step: far less host time per layer, less overlap); auto: "
        "per_step while the slow rows hold at most 512K tokens in all, or when they all attend "
        "through their compact sets (slow_attention keys)",
    )
    slow_in_graph: bool | None = Field(
        None,
        description=(
            "GPU kernel path: a step whose slow rows all take the per-step refresh runs in the full CUDA "
            "graph of a fast step (the slow rows attend in the fast-step kernel, which stages their "
            "queries for the refresh). Unset: wherever the other settings allow it (slow_refresh auto or "
            "per_step, no layer_interleaved_refresh); true: the same, an error where they exclude it; "
            "false: slow steps run eagerly"
        ),
    )
    fused_scores_tokens: Literal["auto"] | NonNegativeInt = Field(
        "auto",
        description=(
            "GPU kernel path, slow_in_graph: buffers allocated at start-up for the slow rows' logits and "
            "key norms, in frame tokens (a group of slow rows takes its rows x its longest context rounded "
            "up to 2048, per layer); a group that does not fit is scored into scratch after the step "
            "(counted in fused_score_misses). Costs tokens x layers x (query heads + KV heads) x 4 bytes. "
            "auto: at most 2 GiB, 2% of the GPU's memory and max_num_seqs x max_model_len (rounded up to "
            "2048); 0: off (docs/settings.md)"
        ),
    )
    drafter_graphs: bool = Field(
        True,
        description=(
            "sfi.mode lossless on CUDA, without tensor, pipeline or data parallelism: run the drafter's "
            "one-token passes as full CUDA graphs, one per padded batch size, each captured at its first "
            "use after one piecewise run (a one-off pause; their memory is outside vLLM's KV-cache sizing). "
            "vLLM 0.26 gives a "
            "drafter piecewise graphs only, whose passes are host-bound (docs/settings.md)"
        ),
    )
    drafter_kv: Literal["shared", "own"] = Field(
        "shared",
        description=(
            "sfi.mode lossless: where the drafter keeps its keys and values. shared: it reads the model's "
            "KV cache and writes only the tokens the model has not computed yet, so the pool holds as many "
            "tokens as a dense engine's (twice own's) and its first pass is one token per row; own: a "
            "cache as large as the model's, "
            "with its own entries, as vLLM's draft_model method keeps (docs/lossless.md)"
        ),
    )
    balanced_splits: bool = Field(
        True,
        description=(
            "GPU kernel path, uniform decode launches (one token per row): each row of the fast-step "
            "kernel takes a share of the launch's programs in proportion to the keys it reads, so that "
            "a dense row among fast rows (a request in its dense bridge, a pool-full fallback) does not "
            "leave the launch waiting on a few long programs; false: every row the same split count. "
            "End to end on an H100 at 16 x 16K: 2.03-2.04x dense against 1.40-1.41x with 2 of 16 rows "
            "dense; level (within 1%) where every request has its set, at 16 x 16K and 8 x 32K; the "
            "H200, batches over 16 rows and the lossless mode not measured (docs/settings.md)"
        ),
    )
    experimental: ExperimentalConfig = Field(default_factory=ExperimentalConfig)
    compact_memory_gib: float | None = Field(
        None, gt=0.0, le=1 << 20,
        description="memory of the compact-set pool, in GiB: as many sequences get a compact set at "
        "once as it holds (at most max_num_seqs); a request that finds the pool full runs densely "
        "(counted). Unset: 10% of the GPU's memory on the GPU kernel path, every sequence elsewhere "
        "(sfi_vllm/compact_pool.py)",
    )

    # Observability.
    stats_file: str | None = Field(None, min_length=1, description="append per-request statistics (JSON lines); "
                                "under tensor/pipeline parallelism the rank-0 worker writes them")


class SFIConfig(EngineSettings, Policy):
    """Every SFI knob: the engine's :class:`EngineSettings` and a :class:`Policy` (the engine's own,
    or a request's merged over it by :func:`merge_policy`). Fields are read flat (``cfg.kernels``,
    ``cfg.selected_tokens``); the Policy fields come first. Token counts are per sequence, per
    layer, per KV head."""

    @model_validator(mode="after")
    def _cross_half_checks(self) -> "SFIConfig":
        if self.min_gap > self.reuse_budget and self.mode == "lossy":  # lossless drafting has no min_gap
            raise ValueError(
                f"min_gap ({self.min_gap}) must be <= reuse_budget ({self.reuse_budget})"
            )
        if self.experimental.candidate_pages and self.selector.page_size <= 1:
            raise ValueError("experimental.candidate_pages (an engine setting) needs page selection: "
                             f"selector.page_size must be > 1, not {self.selector.page_size} (the paper "
                             "preset selects token by token)")
        if self.experimental.prompt_window and self.mode != "lossy":
            raise ValueError("experimental.prompt_window (an engine setting) serves the lossy mode's first "
                             "selection; the lossless mode's drafter does not keep prompt queries")
        if self.slow_in_graph is True and (self.slow_refresh == "per_layer" or self.interleaved_refresh_applies):
            raise ValueError("slow_in_graph needs the per-step refresh (slow_refresh per_step or auto) "
                             "and, in the lossy mode, no layer_interleaved_refresh")
        if self.balanced_splits and self.experimental.one_wave_splits:
            raise ValueError("experimental.one_wave_splits needs balanced_splits false: they are two rules "
                             "for the same split counts, and balanced_splits is on by default")
        if self.refresh_overlap and (not self.side_stream or self.mode != "lossy"):
            raise ValueError("refresh_overlap needs side_stream on and mode lossy (a lossless drafter's "
                             "next pass reads the selection its first pass makes)")
        if self.fused_scores_tokens != "auto" and self.fused_scores_tokens > 0 and (
                self.kernels == "torch" or not self.graph_slow_enabled):
            raise ValueError("fused_scores_tokens needs slow steps inside full CUDA graphs: kernels "
                             "auto or triton, slow_in_graph not false, slow_refresh per_step or auto, "
                             "no layer_interleaved_refresh in the lossy mode")
        return self

    def engine_settings(self) -> EngineSettings:
        """The EngineSettings half of this config."""
        return EngineSettings.model_validate({k: getattr(self, k) for k in EngineSettings.model_fields})

    def policy_settings(self) -> Policy:
        """The Policy half of this config."""
        return Policy.model_validate({k: getattr(self, k) for k in Policy.model_fields})

    def fused_tokens_for(self, layers: int, q_heads: int, kv_heads: int, max_num_seqs: int,
                         max_model_len: int, device_bytes: int, frame_bucket: int = 2048) -> int:
        """``fused_scores_tokens`` resolved for a model (0: off). ``auto``: as many frame tokens as
        ``FUSED_AUTO_BYTES`` and ``FUSED_AUTO_FRACTION`` of the GPU's ``device_bytes`` hold, but
        no more than every sequence at the longest context (rounded up to ``frame_bucket``, the
        Selector's frame width) can use."""
        if self.kernels == "torch" or not self.graph_slow_enabled:
            return 0
        if self.fused_scores_tokens != "auto":
            return self.fused_scores_tokens
        per_token = layers * (q_heads + kv_heads) * 4
        budget = min(FUSED_AUTO_BYTES, int(FUSED_AUTO_FRACTION * device_bytes))
        frame = -(-max_model_len // frame_bucket) * frame_bucket
        return min(budget // per_token, max_num_seqs * frame)

    @property
    def overlap_enabled(self) -> bool:
        """Whether the next step may run beside a per-step refresh (``refresh_overlap``, where it applies)."""
        return self.refresh_overlap and self.side_stream and self.mode == "lossy"

    @property
    def graph_slow_enabled(self) -> bool:
        """Whether slow steps may run inside full CUDA graphs (``slow_in_graph`` resolved)."""
        return (self.slow_in_graph is not False and self.slow_refresh != "per_layer"
                and not self.interleaved_refresh_applies)

    @property
    def interleaved_refresh_applies(self) -> bool:
        """``layer_interleaved_refresh`` where it acts: the lossy mode (a lossless drafter's
        re-selection refreshes every layer)."""
        return self.layer_interleaved_refresh and self.mode == "lossy"


def _read_yaml(path: Path, what: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SFIConfigError(f"{what}: file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:  # a directory, no permission, not text
        raise SFIConfigError(f"{what}: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    except (yaml.YAMLError, RecursionError, ValueError) as e:  # nesting or integers past the parser's limits
        raise SFIConfigError(f"{what}: {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SFIConfigError(f"{what}: {path} must hold a mapping of SFI fields")
    return data


def unknown_preset(field: str, name: Any) -> str:
    """The error text for a preset name that is not one of :data:`PRESETS`."""
    text = f"{field}: unknown preset {echo(name)}; allowed: {', '.join(PRESETS)}"
    if isinstance(name, str) and name in REMOVED_PRESETS:
        text += f" ({name!r} was removed: {REMOVED_PRESETS[name]})"
    return text


def preset_values(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise SFIConfigError(unknown_preset("sfi.preset", name))
    return _read_yaml(PRESET_DIR / f"{name}.yaml", f"preset {name!r}")


# An error message repeats a value the user gave in at most about ECHO_CHARS characters (its start
# and end), so that a megabyte-long setting gets a short answer.
ECHO_CHARS = 120
_ECHO = reprlib.Repr()
_ECHO.maxstring = _ECHO.maxlong = _ECHO.maxother = ECHO_CHARS


def echo(value: Any) -> str:
    """``repr(value)`` for an error message, at most about :data:`ECHO_CHARS` characters: its start
    and end, the middle cut (containers item by item, then as a whole)."""
    try:
        text = _ECHO.repr(value)
    except ValueError:  # an int too long to print (Python's limit on int-to-str digits)
        return f"<{type(value).__name__} too long to print>"
    if len(text) > ECHO_CHARS:
        text = f"{text[:ECHO_CHARS // 2 - 2]} ... {text[-(ECHO_CHARS // 2 - 2):]}"
    return text


def _allowed_range(loc: tuple) -> str:
    """'0 <= x <= 4096'-style text for a numeric field, from its declared constraints."""
    model: Any = SFIConfig
    field = None
    for part in loc:
        if not isinstance(part, str) or part not in getattr(model, "model_fields", {}):
            return ""
        field = model.model_fields[part]
        model = field.annotation
    if field is None:
        return ""
    lo = hi = ""
    for m in field.metadata:
        for attr, sym in (("ge", ">="), ("gt", ">")):
            if getattr(m, attr, None) is not None:
                lo = f"{getattr(m, attr)} {sym.replace('>', '<')} "
        for attr, sym in (("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                hi = f" {sym} {getattr(m, attr)}"
    return f"{lo}value{hi}" if lo or hi else ""


def _field_loc(loc: tuple) -> tuple:
    """A pydantic error location without the union branches it tried (``literal['auto']``,
    ``constrained-int``, ``int``): the field's own path, list indexes included. Inside a model
    every part is a field (or a key the model does not have); below a field that is no model,
    only indexes are."""
    model: Any = SFIConfig
    out = []
    for part in loc:
        if isinstance(model, type) and issubclass(model, BaseModel):
            out.append(part)
            field = model.model_fields.get(part) if isinstance(part, str) else None
            model = field.annotation if field is not None else None
        elif isinstance(part, int):
            out.append(part)
    return tuple(out)


def _format_validation_error(err: ValidationError, field_names: Mapping[tuple, str] | None = None) -> str:
    """One line per field at fault: the field (as ``field_names`` spells its location, else
    ``sfi.<loc>``), pydantic's message (a union's branches joined by "or"), the allowed range or
    values, and the value given."""
    lines: dict[tuple, str] = {}
    for e in err.errors():
        field = _field_loc(e["loc"])
        loc = ".".join(str(p) if len(str(p)) <= ECHO_CHARS else f"{str(p)[:ECHO_CHARS // 2]}...({len(str(p))} "
                       "characters)" for p in field) or "(config)"
        name = (field_names or {}).get(field) or f"sfi.{loc}"
        ctx = e.get("ctx") or {}
        rng = _allowed_range(field)
        if not rng and e["type"].startswith("bool"):
            rng = "true or false"
        allowed = f" (allowed: {rng})" if rng else ""
        if e["type"] == "literal_error" and "expected" in ctx:
            allowed = ""
        got = f"; got {echo(e['input'])}" if "input" in e and not isinstance(e["input"], dict) else ""
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "int_parsing_size":  # a number too large for an integer: not a string's fault
            msg = "Input should be an integer"
        if field in lines:  # another branch of a union (Literal["auto"] | int): one line, "or"
            head, _, tail = lines[field].partition("; got ")
            lines[field] = (f"{head} or {msg.removeprefix('Input should be ')}{allowed}"
                            + (f"; got {tail}" if tail else ""))
        else:
            lines[field] = f"  {name}: {msg}{allowed}{got}"
    return "invalid SFI configuration:\n" + "\n".join(lines.values())


def build_config(overrides: dict[str, Any] | None = None, *, use_env: bool = True,
                 field_names: Mapping[tuple, str] | None = None) -> SFIConfig:
    """Merge preset < $SFI_CONFIG file < ``overrides`` and validate. An error's message names
    each field as ``field_names`` spells its location (default ``sfi.<field>``); the error's
    ``locs`` lists the locations at fault."""
    overrides = dict(overrides or {})
    file_values: dict[str, Any] = {}
    if use_env and os.environ.get(ENV_CONFIG_FILE):
        file_values = _read_yaml(Path(os.environ[ENV_CONFIG_FILE]), f"${ENV_CONFIG_FILE}")
    preset = overrides.get("preset", file_values.get("preset"))
    merged: dict[str, Any] = {}
    if preset is not None:
        if not isinstance(preset, str) or preset not in PRESETS:
            error = SFIConfigError(unknown_preset((field_names or {}).get(("preset",), "sfi.preset"), preset))
            error.locs = [("preset",)]
            raise error
        merged.update(preset_values(preset))
    for layer in (file_values, overrides):
        for key, value in layer.items():
            if key == "selector" and isinstance(value, dict):
                merged["selector"] = {**merged.get("selector", {}), **value}
            else:
                merged[key] = value
        # a layer that gives the budget in one form replaces the other form of the layers under it
        # (a fraction in $SFI_CONFIG replaces the preset's K, a K given here the file's fraction);
        # only both forms in one layer contradict
        forms = [k for k in ("selected_tokens", "selected_fraction") if layer.get(k) is not None]
        if len(forms) == 1:
            other = "selected_fraction" if forms[0] == "selected_tokens" else "selected_tokens"
            if other not in layer:
                merged.pop(other, None)
    try:
        return SFIConfig.model_validate(merged)
    except ValidationError as e:
        error = SFIConfigError(_format_validation_error(e, field_names))
        error.locs = list(dict.fromkeys(_field_loc(tuple(x["loc"])) for x in e.errors()))
        raise error from None


def refuse_misspelt_key(additional_config: Mapping) -> None:
    """Raise :class:`SFIConfigError` for an ``--additional-config`` key that is SFI's written
    otherwise (``SFI``, ``sfi-vllm``): the settings under it would be ignored without a word."""
    for key in additional_config:
        if (isinstance(key, str) and key != ADDITIONAL_CONFIG_KEY
                and "".join(c for c in key.lower() if c.isalnum()) in ("sfi", "sfivllm")):
            raise SFIConfigError(f"--additional-config: {key!r} is not SFI's key; give SFI's settings "
                                 f"under {ADDITIONAL_CONFIG_KEY!r} (lower case), with --attention-backend sfi")


def config_from_vllm(vllm_config: Any) -> SFIConfig:
    """The SFIConfig for an engine: ``additional_config["sfi"]`` over $SFI_CONFIG over the preset."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    if not isinstance(extra, dict):
        extra = {}
    refuse_misspelt_key(extra)
    sfi = extra.get(ADDITIONAL_CONFIG_KEY, {})
    if sfi is None:
        sfi = {}
    if not isinstance(sfi, dict):
        raise SFIConfigError(
            f"--additional-config: the {ADDITIONAL_CONFIG_KEY!r} key must be a JSON object; got {echo(sfi)}"
        )
    return build_config(sfi)


def engine_fields() -> tuple[str, ...]:
    """The fields of :class:`EngineSettings`, fixed at start-up; every other SFIConfig field is a
    :class:`Policy` field, which a request may set."""
    return tuple(EngineSettings.model_fields)


def merge_policy(engine: SFIConfig, request: Mapping[str, Any], *,
                 field_names: Mapping[tuple, str] | None = None) -> SFIConfig:
    """The config a request runs with: ``engine`` (an engine's resolved config) with ``request``
    (a request's Policy fields, nested like SFIConfig's: ``{"selector": {"alpha": 1.0}}``)
    applied field by field, validated as SFIConfig. The front end's request validation and the
    worker both reach it through :func:`sfi_vllm.request_config.resolve_request_config`.

    The engine's values are taken as resolved (its preset is not applied again). A preset the
    request names replaces the engine's whole policy: every Policy field takes the preset's value
    (its file over the defaults), then the request's own fields apply over it, so a request's
    ``balanced`` is the balanced policy whatever the engine started with. A fraction
    the request gives replaces the engine's fixed K, and a fixed K replaces the engine's fraction.
    The result's EngineSettings are the engine's: a request may repeat an engine field's value, and
    one that would change it raises :class:`SFIConfigError`. Errors name the request's own keys
    where ``field_names`` maps them, and carry ``locs``, the field paths at fault."""
    names = field_names or {}
    merged = engine.model_dump()
    merged.pop("preset", None)
    given: dict[str, Any] = {}
    if isinstance(request.get("preset"), str) and request["preset"] in PRESETS:
        defaults = Policy.model_validate({}).model_dump()
        merged.update({key: value for key, value in defaults.items() if key != "preset"})
        given = preset_values(request["preset"])
    for key, value in request.items():
        if key == "preset":
            continue
        if key in given and isinstance(given[key], dict) and isinstance(value, Mapping):
            given[key] = {**given[key], **value}
        else:
            given[key] = value
    for key, value in given.items():
        if isinstance(merged.get(key), dict) and isinstance(value, Mapping):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    # The budget the request gives itself replaces the other form, whether the engine or the
    # request's preset supplied that one: only both in the request's own fields contradict.
    own = set(request) - {"preset"}
    if given.get("selected_fraction") is not None and "selected_tokens" not in own:
        merged["selected_tokens"] = None
    if given.get("selected_tokens") is not None and "selected_fraction" not in own:
        merged["selected_fraction"] = None
    if "preset" in request and request["preset"] not in PRESETS:
        merged["preset"] = request["preset"]  # validated (and refused, naming the field) below
    # An engine-wide field the request changes is named as such before the whole config is
    # validated, so a cross-field check it trips (one_wave_splits against balanced_splits) does not
    # hide that the request may not set it; a value that fails on its own is build_config's to name.
    try:
        asked_engine = EngineSettings.model_validate({key: merged[key] for key in EngineSettings.model_fields})
    except ValidationError:
        asked_engine = None
    if asked_engine is not None:
        _refuse_engine_change(asked_engine, engine, request, names)
    cfg = build_config(merged, use_env=False, field_names=names)
    _refuse_engine_change(cfg, engine, request, names)
    return cfg


def _refuse_engine_change(asked_config: BaseModel, engine: SFIConfig, request: Mapping[str, Any],
                          names: Mapping[tuple, str]) -> None:
    """Raise :class:`SFIConfigError` naming the first EngineSettings field whose value in
    ``asked_config`` (validated) differs from ``engine``'s."""
    for key in EngineSettings.model_fields:
        if getattr(asked_config, key) == getattr(engine, key):
            continue
        # the request's own key (the field, or one of its nested fields), else the preset that set it
        own = [p for p in ((key,), *names) if p[:1] == (key,) and p in names]
        path = own[0] if own else (key,) if key in request or "preset" not in request else ("preset",)
        name = names.get(path, f"sfi.{'.'.join(path)}")
        asked, theirs, field = getattr(asked_config, key), getattr(engine, key), key  # asked as validated
        while isinstance(asked, BaseModel) and isinstance(theirs, BaseModel):  # the nested field that differs
            sub = next(f for f in type(asked).model_fields if getattr(asked, f) != getattr(theirs, f))
            asked, theirs, field = getattr(asked, sub), getattr(theirs, sub), f"{field}.{sub}"
        where = f"sfi.{field} " if field != key else ""
        error = SFIConfigError(f"{name}: sfi.{key} is an engine-wide setting; a request cannot change it "
                               f"({where}engine: {echo(theirs)}, request: {echo(asked)}); "
                               "set it in the engine's --additional-config")
        error.locs = [path]
        raise error
