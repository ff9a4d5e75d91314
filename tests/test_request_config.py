"""A request's own SFI settings (sfi_vllm.request_config): the flat ``vllm_xargs`` keys, the JSON
string, the offline mapping, and the checks that make a bad one a request error. The worker never
fails for them (sfi_vllm.controller) and counts the fallback in the metrics."""

import json

import numpy as np
import pytest
import torch

from sfi_vllm.config import SelectorConfig, SFIConfig, SFIConfigError, build_config
from sfi_vllm.request_config import (
    REQUEST_FIXED_KEYS,
    EngineLimits,
    SFIRequestError,
    flat_keys,
    mapping_name,
    resolve_request_config,
)
from sfi_vllm.trigger import StepMode

ENGINE = {"sinks": 4, "selected_tokens": 64, "recent_window": 32, "boundary_token_ids": [7]}


def limits(sfi=ENGINE, max_model_len=1024):
    return EngineLimits.for_engine(build_config(sfi, use_env=False), max_model_len)


def test_flat_keys_come_from_the_models_fields_and_do_not_clash():
    from sfi_vllm.config import ExperimentalConfig

    keys = flat_keys()
    nested = {n: f.annotation for n, f in SFIConfig.model_fields.items() if isinstance(f.annotation, type)
              and issubclass(f.annotation, (SelectorConfig, ExperimentalConfig))}
    assert nested == {"selector": SelectorConfig, "experimental": ExperimentalConfig}
    top = {f"sfi_{n}" for n in SFIConfig.model_fields if n not in nested}
    inner = {f"sfi_{outer}_{n}" for outer, model in nested.items() for n in model.model_fields}
    assert not top & inner, f"flat keys clash: {top & inner}"  # a new field must not shadow another
    assert set(keys) == top | inner
    assert keys["sfi_experimental_selector_top_k"] == ("experimental", "selector_top_k")
    assert keys["sfi_selector_alpha"] == ("selector", "alpha") and keys["sfi_policy"] == ("policy",)


def test_the_three_forms_give_the_same_config():
    lim = limits()
    flat = {"sfi_policy": "snapkv", "sfi_selected_tokens": 32, "sfi_selector_alpha": 1.0}
    nested = {"policy": "snapkv", "selected_tokens": 32, "selector": {"alpha": 1.0}}
    a = resolve_request_config(lim, flat)
    b = resolve_request_config(lim, {"sfi": json.dumps(nested)})
    c = resolve_request_config(lim, {"sfi": nested})
    d = resolve_request_config(lim, {"sfi": {"policy": "snapkv"}, "sfi_selected_tokens": 32,
                                     "sfi_selector_alpha": 1.0})
    assert a == b == c == d
    assert a.policy == "snapkv" and a.selected_tokens == 32 and a.selector.alpha == 1.0
    assert a.recent_window == 32  # the engine's own settings stay under the request's
    # strings are parsed as the field's type (vllm_xargs carries what the client sent)
    assert resolve_request_config(lim, {"sfi_selected_tokens": "16"}).selected_tokens == 16
    # no SFI keys: the engine's config; other extra_args are not ours
    assert resolve_request_config(lim, {"force": {"tokens": [1]}}) is lim.cfg
    assert resolve_request_config(lim, None) is lim.cfg


def test_keys_of_other_extensions_are_left_alone():
    lim = limits()
    assert resolve_request_config(lim, {"sfinder_mode": 1, "sfi2": "x", "other": 3}) is lim.cfg


def test_a_streaming_engine_says_why_a_request_cannot_select():
    lim = limits({**ENGINE, "policy": "streaming"})
    with pytest.raises(SFIRequestError, match="runs policy streaming, which selects nothing") as info:
        resolve_request_config(lim, {"sfi_policy": "sfi"})
    assert info.value.param == "vllm_xargs.sfi_policy" and "raise the engine's" not in str(info.value)


@pytest.mark.parametrize("extra, param, needle", [
    ({"sfi": "dense"}, "vllm_xargs.sfi", "not valid JSON"),
    ({"sfi": ["dense"]}, "vllm_xargs.sfi", "got list"),
    ({"sfi": 3.5}, "vllm_xargs.sfi", "got float"),
    ({"sfi": '"dense"'}, "vllm_xargs.sfi", "got str"),
    # JSON null, and None offline, are no settings object either (the request would run with the
    # engine's settings without a word)
    ({"sfi": "null"}, "vllm_xargs.sfi", "got NoneType"),
    ({"sfi": None}, "vllm_xargs.sfi", "got NoneType"),
    ({"sfi": {"sinkz": 1}}, "vllm_xargs.sfi.sinkz", "unknown SFI setting"),
    ({"sfi_sinkz": 1}, "vllm_xargs.sfi_sinkz", "unknown SFI setting"),
    ({"sfi_selector_alpah": 1}, "vllm_xargs.sfi_selector_alpah", "sfi_selector_alpha"),
    ({"sfi_sinks": -1}, "vllm_xargs.sfi_sinks", "0 <= value <= 4096"),
    ({"sfi": {"selector": {"alpha": 0}}}, "vllm_xargs.sfi.selector.alpha", "0.0 < value <= 4.0"),
    ({"sfi_policy": "fast"}, "vllm_xargs.sfi_policy", "'quest'"),
    ({"sfi_side_stream": False}, "vllm_xargs.sfi_side_stream", "engine-wide"),
    ({"sfi_selected_tokens": 65}, "vllm_xargs.sfi_selected_tokens", "sinks + K <= 68"),
    ({"sfi_sinks": 8}, "vllm_xargs.sfi_sinks", "sinks + K <= 68"),
    ({"sfi_reuse_budget": 4}, "vllm_xargs.sfi_reuse_budget", "min_gap (16) must be <= reuse_budget (4)"),
    # ... and says which of the fields it names hold the engine's values, and their keys
    ({"sfi_reuse_budget": 4}, "vllm_xargs.sfi_reuse_budget", "min_gap (16) is the engine's value, which the "
     "request may set as well (sfi_min_gap)"),
    # an error of two fields names the request's field that the message names, not its first key
    ({"sfi_selected_tokens": 16, "sfi_reuse_budget": 8}, "vllm_xargs.sfi_reuse_budget", "reuse_budget (8)"),
    ({"sfi": {"selected_tokens": 16, "reuse_budget": 8}}, "vllm_xargs.sfi.reuse_budget", "reuse_budget (8)"),
    ({"sfi_sinks": 2, "sfi": {"sinks": 2}}, "vllm_xargs.sfi_sinks", "given twice"),
    ({"sfi_selector_alpha": 1, "sfi": {"selector": {"gamma": 1}}}, None, None),  # different fields: fine
    # ... or the preset's, where the request names one (the speed preset's reuse_budget is 20)
    ({"sfi_preset": "speed", "sfi_min_gap": 30}, "vllm_xargs.sfi_min_gap", "reuse_budget (20) comes from the "
     "preset 'speed'; the request may set it as well (sfi_reuse_budget)"),
    # a number JSON parsing refuses is no duplicate key
    ({"sfi": '{"reuse_budget": ' + "1" * 5000 + "}"}, "vllm_xargs.sfi", "not valid JSON"),
    # nesting past the parser's depth (RecursionError) is a malformed string, not a server error
    ({"sfi": "[" * 100_000}, "vllm_xargs.sfi", "not valid JSON"),
    ({"sfi": '{"a": ' * 5000 + "1" + "}" * 5000}, "vllm_xargs.sfi", "not valid JSON"),
    # a key twice in the JSON string (json.loads alone would keep the last without a word)
    ({"sfi": '{"selected_tokens": 16, "selected_tokens": 32}'}, "vllm_xargs.sfi", "'selected_tokens' is given twice"),
    ({"sfi": '{"selector": {"alpha": 1, "alpha": 2}}'}, "vllm_xargs.sfi", "'alpha' is given twice"),
    # a boolean is not a count (pydantic's lax mode would read true as 1), NaN and infinity are no numbers
    ({"sfi": '{"reuse_budget": true}'}, "vllm_xargs.sfi.reuse_budget", "not the boolean True"),
    # a string with Python's digit separator is no number here (lax mode would read "1_0" as 10)
    ({"sfi_selector_alpha": "1_0"}, "vllm_xargs.sfi_selector_alpha", "not the string '1_0' (digit separators"),
    ({"sfi": '{"selected_tokens": "1_000"}'}, "vllm_xargs.sfi.selected_tokens", "digit separators are not read"),
    ({"sfi_selected_tokens": False}, "vllm_xargs.sfi_selected_tokens", "not the boolean False"),
    ({"sfi_selector_alpha": float("nan")}, "vllm_xargs.sfi_selector_alpha", "finite number"),
    ({"sfi": '{"selector": {"gamma": Infinity}}'}, "vllm_xargs.sfi.selector.gamma", "finite number"),
    # our keys in another letter case are refused, not ignored
    ({"SFI_POLICY": "dense"}, "vllm_xargs.SFI_POLICY", "did you mean 'sfi_policy'"),
    ({"Sfi": '{"sinks": 2}'}, "vllm_xargs.Sfi", "did you mean 'sfi'"),
    ({"SFI_SINKZ": 2}, "vllm_xargs.SFI_SINKZ", "unknown SFI setting"),
    # the dotted form the docs use for fields, and other separators: refused, not ignored (the
    # request would otherwise run with the engine's settings)
    ({"sfi.selected_tokens": 512}, "vllm_xargs.sfi.selected_tokens", "did you mean 'sfi_selected_tokens'"),
    ({"sfi_selectd_tokens": 512}, "vllm_xargs.sfi_selectd_tokens", "did you mean 'sfi_selected_tokens'"),
    ({"sfi": '{"selectd_tokens": 512}'}, "vllm_xargs.sfi.selectd_tokens", "did you mean 'selected_tokens'"),
    ({"sfi-selector-alpha": 1}, "vllm_xargs.sfi-selector-alpha", "did you mean 'sfi_selector_alpha'"),
    ({"sfi ": '{"sinks": 2}'}, "vllm_xargs.sfi ", "did you mean 'sfi'"),
    ({"sfi_": "dense"}, "vllm_xargs.sfi_", "did you mean 'sfi'"),
    # a setting's name without its separators
    ({"sfiPolicy": "dense"}, "vllm_xargs.sfiPolicy", "did you mean 'sfi_policy'"),
    ({"sfiselectedtokens": 512}, "vllm_xargs.sfiselectedtokens", "did you mean 'sfi_selected_tokens'"),
    # look-alike letters (long s, full width) are the same name after NFKC, not another extension's
    ({"\u017ffi_policy": "dense"}, "vllm_xargs.\u017ffi_policy", "did you mean 'sfi_policy'"),
    ({"\uff53\uff46\uff49_sinks": 2}, "vllm_xargs.\uff53\uff46\uff49_sinks", "did you mean 'sfi_sinks'"),
    # a value the request's preset set: the error names the preset, the field the client sent
    ({"sfi_preset": "speed"}, "vllm_xargs.sfi_preset", "sinks + K <= 68"),
    # Quest takes K in whole pages: a page larger than K would select nothing at every context
    ({"sfi_policy": "quest", "sfi_quest_page": 64, "sfi_selected_tokens": 32}, "vllm_xargs.sfi_quest_page",
     "quest_page (64) must be <= selected_tokens (32)"),
    # with a fraction: a page above the largest K the fraction gives within max_model_len (1024)
    ({"sfi_policy": "quest", "sfi_selected_fraction": 0.001, "sfi_selected_floor": 16, "sfi_quest_page": 32},
     "vllm_xargs.sfi_quest_page", "quest_page (32) must be <= 16, the largest K that selected_fraction 0.001"),
    # over HTTP a JSON false reaches extra_args as 0: the message shows the value as the field reads it
    ({"sfi_side_stream": 0}, "vllm_xargs.sfi_side_stream", "request: False"),
    # null is no value: merged, it would take the class default (K = 2048) instead of the engine's
    ({"sfi": '{"selected_fraction": null}'}, "vllm_xargs.sfi.selected_fraction", "null is not a value"),
    ({"sfi_selected_tokens": None}, "vllm_xargs.sfi_selected_tokens", "leave it out to keep the engine's budget"),
    ({"sfi_policy": None}, "vllm_xargs.sfi_policy", "leave the setting out"),
    ({"sfi": {"selector": {"alpha": None}}}, "vllm_xargs.sfi.selector.alpha", "null is not a value"),
    # a group given as something else is named as such, not as a clash with its flat keys
    ({"sfi": '{"selector": "oops"}', "sfi_selector_alpha": 0.1}, "vllm_xargs.sfi.selector",
     "must be an object of selector settings"),
    ({"sfi_selector": '{"alpha": 1}'}, "vllm_xargs.sfi_selector", "(sfi_selector_alpha)"),
    # a union field's error: one line, the field's own name
    ({"sfi_fused_scores_tokens": "AUTO"}, "vllm_xargs.sfi_fused_scores_tokens",
     "vllm_xargs.sfi_fused_scores_tokens: Input should be 'auto' or"),
])
def test_bad_request_settings_name_the_field(extra, param, needle):
    if param is None:
        assert resolve_request_config(limits(), extra).selector.alpha == 1
        return
    with pytest.raises(SFIRequestError) as info:
        resolve_request_config(limits(), extra)
    assert info.value.param == param and needle in str(info.value), (info.value.param, str(info.value))
    if extra == {"sfi_preset": "speed", "sfi_min_gap": 30}:
        assert "engine's value" not in str(info.value)


@pytest.mark.parametrize("extra, param", [
    ({"sfi_policy": "a" * 1_000_000}, "vllm_xargs.sfi_policy"),
    ({"sfi_policy": "a " * 100_000}, "vllm_xargs.sfi_policy"),  # spaces: cut where it is formatted
    ({"sfi_policy": ["x" * 1000] * 10}, "vllm_xargs.sfi_policy"),
    ({"sfi_sinks": "9" * 5000}, "vllm_xargs.sfi_sinks"),
    ({"sfi_sinks": "1_ " * 100_000}, "vllm_xargs.sfi_sinks"),  # a digit separator
    ({"sfi_preset": "a " * 100_000}, "vllm_xargs.sfi_preset"),
    ({"sfi_stats_file": "a " * 100_000}, "vllm_xargs.sfi_stats_file"),  # engine-wide
    ({"sfi_boundary_token_ids": list(range(100_000))}, "vllm_xargs.sfi_boundary_token_ids"),
    ({"sfi": '{"sinks": 1, "%s": 1, "%s": 2}' % ("k " * 10_000, "k " * 10_000)}, "vllm_xargs.sfi"),  # twice
    ({"sfi": json.dumps({"sinks": "x" * 10_000})}, "vllm_xargs.sfi.sinks"),
    ({"sfi_sinks": 10 ** 5000}, "vllm_xargs.sfi_sinks"),  # offline: an int too long to print
])
def test_an_error_repeats_a_long_value_only_in_part(extra, param):
    """A megabyte-long value gets a short answer that names the field: the value cut to its start
    and end where the message formats it."""
    with pytest.raises(SFIRequestError) as info:
        resolve_request_config(limits(), extra)
    assert info.value.param == param and param in str(info.value), info.value.param
    assert len(str(info.value)) < 600, str(info.value)[:600]


def test_an_error_cuts_a_long_key_and_lists_the_allowed_keys_whole():
    with pytest.raises(SFIRequestError) as info:
        resolve_request_config(limits(), {"sfi_" + "x" * 100_000: 1})
    msg = str(info.value)
    assert info.value.param == "vllm_xargs.sfi_" + "x" * 45 + "...(100015 characters)"
    assert msg.startswith("vllm_xargs.sfi_" + "x" * 45 + "...(100016 characters) unknown SFI setting")
    assert len(msg) < 2500 and all(f"{k}," in msg for k in ("sfi_sinks", "sfi_policy", "sfi_reuse_budget"))


def test_an_engines_config_refuses_booleans_for_numbers_and_non_finite_numbers():
    for bad, needle in (({"reuse_budget": True}, "not the boolean"), ({"fused_scores_tokens": False}, "not the boolean"),
                        ({"boundary_token_ids": [7, True]}, "holds a boolean"),
                        ({"boundary_token_ids": (7, np.bool_(True))}, "holds a boolean"),
                        ({"selected_fraction": np.bool_(True)}, "not the boolean"),
                        ({"compact_memory_gib": float("inf")}, "finite number")):
        with pytest.raises(SFIConfigError, match=needle):
            build_config(bad, use_env=False)
    assert build_config({"reuse_budget": 20.0, "boundary_trigger": 1}, use_env=False).reuse_budget == 20


def test_a_fixed_key_at_the_engines_value_and_a_dense_request_of_any_budget_are_accepted():
    lim = limits()
    for key in REQUEST_FIXED_KEYS:
        value = getattr(lim.cfg, key)
        value = value.model_dump() if hasattr(value, "model_dump") else value  # a group as plain data
        assert resolve_request_config(lim, {"sfi": {key: value}}) == lim.cfg
    assert resolve_request_config(lim, {"sfi_policy": "dense", "sfi_selected_tokens": 4096}).policy == "dense"


def test_boundary_trigger_needs_the_engines_enders():
    trigger_off = build_config({**ENGINE, "boundary_token_ids": None, "boundary_trigger": False}, use_env=False)
    # an engine with a tokenizer has its enders with its own trigger off: a request may turn it on
    assert resolve_request_config(EngineLimits.for_engine(trigger_off, 1024), {"sfi_boundary_trigger": 1}).boundary_trigger
    no_enders = EngineLimits.for_engine(trigger_off, 1024, has_tokenizer=False)  # skip_tokenizer_init
    with pytest.raises(SFIRequestError, match="sentence-ender") as info:
        resolve_request_config(no_enders, {"sfi_boundary_trigger": True})
    assert info.value.param == "vllm_xargs.sfi_boundary_trigger"
    assert resolve_request_config(no_enders, {"sfi_boundary_trigger": False}).boundary_trigger is False
    assert resolve_request_config(limits(), {"sfi_boundary_trigger": "true"}).boundary_trigger is True


def test_the_front_end_raises_vllms_validation_error():
    from vllm.exceptions import VLLMValidationError
    from vllm import SamplingParams

    from sfi_vllm import request_validation

    request_validation.set_engine_limits(limits())
    try:
        with pytest.raises(VLLMValidationError) as info:
            request_validation.validate_request_params(SamplingParams(extra_args={"sfi_sinks": "x"}))
        assert info.value.parameter == "vllm_xargs.sfi_sinks"
        with pytest.raises(VLLMValidationError) as info:  # the offline mapping: named as written there
            request_validation.validate_request_params(SamplingParams(extra_args={"sfi": {"sinks": "x"}}))
        assert info.value.parameter == "extra_args.sfi.sinks"
        with pytest.raises(VLLMValidationError) as info:  # a flat key beside it: named as over HTTP
            request_validation.validate_request_params(
                SamplingParams(extra_args={"sfi": {"sinks": 2}, "sfi_sinks": 2}))
        assert info.value.parameter == "vllm_xargs.sfi_sinks" and "also as extra_args.sfi.sinks" in str(info.value)
        request_validation.validate_request_params(SamplingParams(extra_args={"sfi_sinks": 2}))
        request_validation.validate_request_params(SamplingParams())
    finally:
        request_validation.set_engine_limits(None)
    request_validation.validate_request_params(SamplingParams(extra_args={"sfi": "x"}))  # no SFI engine


def test_the_lossless_mode_refuses_what_speculative_decoding_cannot_serve():
    """vLLM's speculative decoding returns no logprobs for ``logprob_token_ids`` (its OpenAI route then
    fails with a 500) and refuses min_p and logit_bias without naming them: a lossless engine
    refuses the three with a 400 naming the field; a lossy one, and a lossless one without them,
    let the request through."""
    from vllm.exceptions import VLLMValidationError
    from vllm import SamplingParams

    from sfi_vllm import request_validation

    lossless = build_config({**ENGINE, "mode": "lossless"}, use_env=False)
    asked = SamplingParams(logprobs=1, logprob_token_ids=[5, 6])
    try:
        request_validation.set_engine_limits(EngineLimits.for_engine(lossless, 1024))
        with pytest.raises(VLLMValidationError, match="not supported in sfi.mode lossless") as info:
            request_validation.validate_request_params(asked)
        assert info.value.parameter == "logprob_token_ids"
        for name, params in (("min_p", SamplingParams(min_p=0.1)), ("logit_bias", SamplingParams(logit_bias={5: 1.0}))):
            with pytest.raises(VLLMValidationError, match=f"{name} is not supported in sfi.mode lossless") as info:
                request_validation.validate_request_params(params)
            assert info.value.parameter == name
        request_validation.validate_request_params(SamplingParams(logprobs=2, extra_args={"sfi_sinks": 2}))
        request_validation.set_engine_limits(limits())
        request_validation.validate_request_params(asked)
    finally:
        request_validation.set_engine_limits(None)


@pytest.mark.parametrize("extra", [{"sfi": "dense"}, {"sfi": [1]}, {"sfi": 7}, {"sfi": None, "sfi_x": 1},
                                   {"sfi": {1: 2}}, {"sfi_sinks": object()}, {"sfi": {"selector": [1]}}])
def test_the_worker_runs_a_bad_request_densely_and_counts_it(extra):
    from test_policies import controller

    ctl = controller()
    metric = ctl.stats.metrics.fallbacks.labels(reason="config_error")
    before = metric._value.get()
    p = ctl.plan_step(["bad", "good"], np.ones(2, int), np.array([500, 500]), [400, 400],
                      torch.tensor([3, 3]), [extra, None])
    assert p.modes[0] == StepMode.DENSE and p.modes[1] == StepMode.SLOW
    st = ctl.stats.get("bad")
    assert st.fallback == "config_error" and st.config_error and st.policy == "dense"
    assert metric._value.get() == before + 1


def test_step_metrics_follow_the_statistics():
    from test_policies import controller

    ctl = controller({"reuse_budget": 2, "min_gap": 0}, n=2)
    m = ctl.stats.metrics
    fast, slow = m.fast_steps._value.get(), m.slow_steps.labels(reason="reuse_budget")._value.get()
    first = m.slow_steps.labels(reason="first_decode")._value.get()
    served = m.requests.labels(policy="sfi")._value.get()
    for step in range(7):  # slow, fast, fast, slow (budget), fast, fast, slow
        ctl.plan_step(["a"], np.ones(1, int), np.array([600 + step]), [500], torch.tensor([3]))
        ctl.end_step()
    assert m.fast_steps._value.get() - fast == 4
    assert m.slow_steps.labels(reason="reuse_budget")._value.get() - slow == 2
    assert m.slow_steps.labels(reason="first_decode")._value.get() - first == 1

    class Out:
        finished_req_ids, preempted_req_ids = {"a"}, ()

    ctl.on_scheduler_output(Out())
    assert m.requests.labels(policy="sfi")._value.get() - served == 1


def test_a_request_merges_over_the_engine_as_resolved_not_over_its_preset_again():
    """The engine's preset is applied once, at start-up: a request's settings merge over the
    resolved values (fields the engine set back to their defaults stay set); a preset the request
    names applies under its own fields; a fixed K and a fraction replace each other."""
    from sfi_vllm.config import build_config
    from sfi_vllm.config import merge_policy

    engine = build_config({"preset": "speed", "boundary_trigger": True, "reuse_budget": 64,
                           "selector": {"page_size": 16}}, use_env=False)
    got = merge_policy(engine, {"selected_tokens": 1024})
    assert (got.boundary_trigger, got.reuse_budget, got.selector.page_size, got.selected_tokens) == (True, 64, 16, 1024)
    paper = merge_policy(build_config({}, use_env=False), {"preset": "paper", "reuse_budget": 40})
    assert (paper.selector.page_size, paper.bridge_steps, paper.reuse_budget) == (0, 0, 40)
    frac = build_config({"selected_fraction": 0.2}, use_env=False)
    k = merge_policy(frac, {"selected_tokens": 512})
    assert (k.selected_tokens, k.selected_fraction) == (512, None)
    back = merge_policy(build_config({}, use_env=False), {"selected_fraction": 0.1})
    assert (back.selected_tokens, back.selected_fraction) == (None, 0.1)
    # fields beside a preset override it, the budget's form included: the speed preset's fixed K
    # gives way to the request's own fraction (and a fraction-engine's to the preset's K)
    mixed = merge_policy(build_config({}, use_env=False), {"preset": "speed", "selected_fraction": 0.2})
    assert (mixed.selected_tokens, mixed.selected_fraction, mixed.reuse_budget) == (None, 0.2, 20)
    fixed = merge_policy(frac, {"preset": "speed"})
    assert (fixed.selected_tokens, fixed.selected_fraction) == (2048, None)
    # a request's preset is that preset's whole policy: nothing of the engine's own policy carries
    # into it (the paper engine's token-level Selector and dense slow steps), its engine-wide settings do
    paper_engine = build_config({"preset": "paper", "recent_window": 128, "side_stream": False}, use_env=False)
    balanced = merge_policy(paper_engine, {"preset": "balanced", "sinks": 8})
    expected = build_config({"preset": "balanced", "sinks": 8, "side_stream": False}, use_env=False)
    assert balanced.model_dump(exclude={"preset"}) == expected.model_dump(exclude={"preset"})
    assert (balanced.slow_attention, balanced.selector.use_nms, balanced.recent_window) == ("keys", False, 256)
    with pytest.raises(SFIConfigError, match="not both"):
        merge_policy(build_config({}, use_env=False), {"selected_tokens": 512, "selected_fraction": 0.2})


def test_the_engine_wide_fields_are_declared_on_the_model_and_refused_per_request():
    """The settings a request may not change are the fields of EngineSettings, so a new
    engine-wide field is refused per request and shown as such in the README's table."""
    from sfi_vllm.config import EngineSettings, engine_fields

    assert REQUEST_FIXED_KEYS == engine_fields()
    assert {"kernels", "side_stream", "compact_memory_gib", "stats_file"} <= set(REQUEST_FIXED_KEYS)
    assert not {"sinks", "selected_tokens", "policy", "selector"} & set(REQUEST_FIXED_KEYS)
    lim = limits()
    other = {"kernels": "torch", "side_stream": False, "stats_file": "/tmp/x.jsonl", "compact_memory_gib": 1.0}
    for key, value in other.items():
        assert getattr(lim.cfg, key) != value
        with pytest.raises(SFIRequestError, match=f"sfi.{key} is an engine-wide setting"):
            resolve_request_config(lim, {f"sfi_{key}": value})
    assert REQUEST_FIXED_KEYS == tuple(EngineSettings.model_fields)


def test_an_experimental_option_is_engine_wide_and_named_as_the_client_wrote_it():
    lim = limits()
    with pytest.raises(SFIRequestError, match="sfi.experimental is an engine-wide setting") as e:
        resolve_request_config(lim, {"sfi_experimental_selector_top_k": "triton"})
    assert e.value.param == "vllm_xargs.sfi_experimental_selector_top_k"
    # the message names the nested field that differs, not the whole group
    assert "(sfi.experimental.selector_top_k engine: 'auto', request: 'triton')" in str(e.value)
    assert "ExperimentalConfig(" not in str(e.value)
    same = resolve_request_config(lim, {"sfi": {"experimental": {"selector_top_k": "auto"}}})  # the engine's
    assert same.experimental.selector_top_k == "auto"
    with pytest.raises(SFIRequestError, match="engine-wide: a request may only repeat the engine's values"):
        resolve_request_config(lim, {"sfi_experimental": 1})
    # an engine-wide option that would also trip a cross-field check is named as engine-wide
    with pytest.raises(SFIRequestError, match="sfi.experimental is an engine-wide setting") as e:
        resolve_request_config(lim, {"sfi_experimental_one_wave_splits": 1})
    assert e.value.param == "vllm_xargs.sfi_experimental_one_wave_splits"
    assert "needs balanced_splits false" not in str(e.value)
    # its old top-level place is named with the new one, as at start-up
    for extra, param in (({"sfi": '{"selector_top_k": "torch"}'}, "vllm_xargs.sfi.selector_top_k"),
                         ({"sfi_selector_top_k": "torch"}, "vllm_xargs.sfi_selector_top_k")):
        with pytest.raises(SFIRequestError, match="moved to sfi.experimental.selector_top_k") as info:
            resolve_request_config(lim, extra)
        assert info.value.param == param
    with pytest.raises(SFIConfigError, match="moved to sfi.experimental.selector_top_k"):
        build_config({"selector_top_k": "torch"}, use_env=False)
    # experimental fields that became settings, flat and nested
    for extra, needle in (({"sfi_experimental_balanced_splits": True}, r"moved to sfi.balanced_splits \(sfi_balanced_splits\)"),
                          ({"sfi_experimental_drafter_graphs": False}, r"moved to sfi.drafter_graphs \(sfi_drafter_graphs\)"),
                          ({"sfi": {"experimental": {"balanced_splits": True}}}, "moved to sfi.balanced_splits")):
        with pytest.raises((SFIRequestError, SFIConfigError), match=needle):
            resolve_request_config(lim, extra)


def _union(engine: dict, request: dict) -> dict:
    out = {**engine, **request}
    for key in engine.keys() & request.keys():
        if isinstance(engine[key], dict):
            out[key] = {**engine[key], **request[key]}
    return out


MERGE_ENGINES = [{}, ENGINE, {"kernels": "torch", "side_stream": False, "boundary_read": "exact", "sinks": 8,
                              "selector": {"alpha": 2.0, "use_nms": True}, "compact_memory_gib": 2.0},
                 {"selected_fraction": 0.25, "selected_cap": 4096, "stats_file": "/tmp/s.jsonl", "reuse_budget": 30}]
MERGE_REQUESTS = [{}, {"policy": "dense"}, {"sinks": 2, "recent_window": 64, "selector": {"gamma": 1.0}},
                  {"policy": "quest", "quest_page": 32, "boundary_trigger": False, "min_gap": 4},
                  {"selector": {"page_size": 0, "follow_pages": 0}, "window_mode": "slide"}]


@pytest.mark.parametrize("engine", MERGE_ENGINES)
@pytest.mark.parametrize("request_", MERGE_REQUESTS)
def test_merging_a_policy_over_an_engine_equals_building_the_union(engine, request_):
    from sfi_vllm.config import Policy, merge_policy

    Policy.model_validate(request_)  # the requests are Policies
    base = build_config(engine, use_env=False)
    assert merge_policy(base, request_) == build_config(_union(engine, request_), use_env=False)


# a value other than the default for every EngineSettings field
OTHER_ENGINE_VALUES = {"mode": "lossless", "newline_is_boundary": False, "boundary_token_ids": [1, 2],
                       "boundary_read": "exact", "kernels": "torch", "side_stream": False, "refresh_overlap": True,
                       "slow_refresh": "per_layer", "slow_in_graph": False, "fused_scores_tokens": 0, "drafter_graphs": False, "drafter_kv": "own",
                       "balanced_splits": False,
                       "experimental": {"selector_top_k": "triton"}, "compact_memory_gib": 1.0,
                       "stats_file": "/tmp/s.jsonl"}


def test_a_request_merge_cannot_change_an_engine_setting(monkeypatch):
    from sfi_vllm import config
    from sfi_vllm.config import EngineSettings, SFIConfigError, merge_policy

    assert set(OTHER_ENGINE_VALUES) == set(EngineSettings.model_fields)
    engine = build_config({}, use_env=False)
    for key, value in OTHER_ENGINE_VALUES.items():
        assert getattr(engine, key) != getattr(build_config({key: value}, use_env=False), key)
        with pytest.raises(SFIConfigError, match=rf"sfi\.{key}: sfi\.{key} is an engine-wide setting") as e:
            merge_policy(engine, {key: value, "sinks": 2})
        assert e.value.locs == [(key,)]
        assert merge_policy(engine, {key: getattr(engine, key), "sinks": 2}).engine_settings() == engine.engine_settings()
    for request in [*MERGE_REQUESTS, {"preset": "paper"}, {"preset": "speed", "policy": "snapkv"}]:
        assert merge_policy(engine, request).engine_settings() == engine.engine_settings()
    # a preset that reached an engine-wide field would be refused, named as the preset
    real = config.preset_values
    monkeypatch.setattr(config, "preset_values", lambda name: {**real(name), "kernels": "torch"})
    with pytest.raises(SFIConfigError, match=r"^req\.preset: sfi\.kernels is an engine-wide setting") as e:
        merge_policy(engine, {"preset": "paper"}, field_names={("preset",): "req.preset"})
    assert e.value.locs == [("preset",)]


def test_a_lossless_request_may_set_a_reuse_budget_below_min_gap():
    """min_gap paces the lossy mode's slow steps; the lossless drafter has none to pace."""
    lossless = resolve_request_config(limits({**ENGINE, "mode": "lossless"}),
                                      {"sfi_draft_reselect": "reuse_budget", "sfi_reuse_budget": 8})
    assert (lossless.reuse_budget, lossless.min_gap) == (8, 16)
    with pytest.raises(SFIRequestError, match=r"min_gap \(16\) must be <= reuse_budget \(8\)"):
        resolve_request_config(limits(), {"sfi_reuse_budget": 8})


def test_a_null_budget_form_beside_the_other_and_a_null_preset_are_no_settings():
    """What ``sfi-vllm config`` prints for a config with a fraction (``"selected_tokens": null``)
    or no preset (``"preset": null``) reads as a request the same way."""
    lim = limits(max_model_len=8192)
    got = resolve_request_config(lim, {"sfi": '{"selected_fraction": 0.005, "selected_tokens": null}'})
    assert (got.selected_fraction, got.selected_tokens) == (0.005, None)
    assert resolve_request_config(lim, {"sfi": '{"preset": null}'}) is lim.cfg
    assert resolve_request_config(lim, {"sfi_preset": None, "sfi_sinks": 2}).sinks == 2


def test_values_vllm_cannot_send_to_its_engine_process_are_refused():
    """vLLM sends ``extra_args`` to the engine process with msgpack: a settings object, a numpy
    scalar (alone, in a list, or as the ``sfi`` string) or an integer past 64 bits in a list fails
    there after the request is half added (an offline engine then hangs), so validation refuses
    them, naming the field. What msgpack sends (dict subclasses, tuples) passes on to the fields'
    own checks, which also bound a single integer."""
    from collections import OrderedDict
    from types import MappingProxyType

    from vllm.v1.serial_utils import MsgpackEncoder

    lim = limits()
    cases = [
        ({"sfi": {"selector": SelectorConfig(alpha=1.0)}}, "extra_args.sfi.selector", "as a dict"),
        ({"sfi": {"selected_tokens": np.int64(64)}}, "extra_args.sfi.selected_tokens", "numpy.int64"),
        ({"sfi_selector_alpha": np.float64(1.0)}, "vllm_xargs.sfi_selector_alpha", "numpy.float64"),
        ({"sfi_boundary_token_ids": [7, np.int32(8)]}, "vllm_xargs.sfi_boundary_token_ids", "numpy.int32"),
        ({"sfi_boundary_token_ids": [2**64]}, "vllm_xargs.sfi_boundary_token_ids", "serialize ints"),
        ({"sfi": np.str_('{"sinks": 4}')}, "vllm_xargs.sfi", "numpy.str_"),
    ]
    encoder = MsgpackEncoder()
    for extra, param, needle in cases:
        with pytest.raises((TypeError, OverflowError)):  # what the refusal guards against
            encoder.encode(extra)
        with pytest.raises(SFIRequestError, match=needle) as info:
            resolve_request_config(lim, extra, mapping_where=mapping_name(extra))
        assert info.value.param == param
    # vLLM sends arrays and tensors as raw buffers, from which the worker cannot read the setting
    for extra, param in (({"sfi_sinks": np.array(2)}, "vllm_xargs.sfi_sinks"),
                         ({"sfi_selector_alpha": torch.tensor(1.5)}, "vllm_xargs.sfi_selector_alpha"),
                         ({"sfi_boundary_token_ids": np.array([7])}, "vllm_xargs.sfi_boundary_token_ids")):
        with pytest.raises(SFIRequestError, match="not plain data") as info:
            resolve_request_config(lim, extra)
        assert info.value.param == param
    with pytest.raises(SFIRequestError, match="unknown selector setting 1") as info:
        resolve_request_config(lim, {"sfi": {"selector": {1: 2.0}}})
    with pytest.raises(SFIRequestError, match="must be an object of SFI settings") as info:
        resolve_request_config(lim, {"sfi": MappingProxyType({"sinks": 4})})
    with pytest.raises(SFIRequestError, match=r"allowed: 1 <= value") as info:  # the field's bound
        resolve_request_config(lim, {"sfi_reuse_budget": 2**64})
    # a single int passes the plain-data check because every integer setting a request may give
    # is bounded: one past 64 bits never reaches vLLM's encoder
    for key in flat_keys():
        for big in (2**64, -2**63 - 1):
            with pytest.raises(SFIRequestError):
                resolve_request_config(lim, {key: big})
    with pytest.raises(SFIRequestError, match="valid integer") as info:  # pydantic's type error
        resolve_request_config(lim, {"sfi": '{"sinks": {"x": 1}}'})
    plain = {"sfi": OrderedDict(selector=OrderedDict({np.str_("alpha"): 1.0}), selected_tokens=32),
             "sfi_boundary_token_ids": (7,)}
    encoder.encode(plain)
    got = resolve_request_config(lim, plain, mapping_where=mapping_name(plain))
    assert (got.selector.alpha, got.selected_tokens, tuple(got.boundary_token_ids)) == (1.0, 32, (7,))


def test_the_sfi_entry_is_named_as_the_caller_wrote_it():
    """``extra_args`` for what only an offline caller can pass (an object, None), ``vllm_xargs``
    for what an HTTP request carries as well (a JSON string, a number, a list, flat keys)."""
    lim = limits()
    for extra, param in (({"sfi": None}, "extra_args.sfi"), ({"sfi": {"sinkz": 1}}, "extra_args.sfi.sinkz"),
                         ({"sfi": "null"}, "vllm_xargs.sfi"), ({"sfi": 3}, "vllm_xargs.sfi"),
                         ({"sfi": ["x"]}, "vllm_xargs.sfi"), ({"sfi_sinkz": 1}, "vllm_xargs.sfi_sinkz")):
        with pytest.raises(SFIRequestError) as info:
            resolve_request_config(lim, extra, mapping_where=mapping_name(extra))
        assert info.value.param == param, (extra, info.value.param)


def test_a_preset_that_outgrows_the_buffers_is_named_with_what_it_brings():
    """A request's preset brings its whole budget (K, or the default selected_cap beside a
    fraction): the refusal names the preset, not the fraction the request repeated."""
    lim = limits({"selected_fraction": 0.05, "selected_cap": 1024, "boundary_token_ids": [7]}, 131072)
    with pytest.raises(SFIRequestError, match="brings its own budget, selected_cap included") as info:
        resolve_request_config(lim, {"sfi_preset": "balanced", "sfi_selected_fraction": 0.05})
    assert info.value.param == "vllm_xargs.sfi_preset"
    assert resolve_request_config(lim, {"sfi_preset": "balanced", "sfi_selected_fraction": 0.05,
                                        "sfi_selected_cap": 1024}).selected_cap == 1024
    with pytest.raises(SFIRequestError) as info:  # the request's own K: named, no word of the preset
        resolve_request_config(lim, {"sfi_preset": "speed", "sfi_selected_tokens": 4096})
    assert info.value.param == "vllm_xargs.sfi_selected_tokens" and "brings" not in str(info.value)


def test_a_lossless_engine_without_enders_takes_requests_that_ask_for_the_boundary_trigger():
    """Lossless mode runs no boundary trigger, so a preset or a request's boundary_trigger asks for
    nothing the engine lacks; the lossy engine (started without a tokenizer) refuses them."""
    for mode, refused in (("lossy", True), ("lossless", False)):
        cfg = build_config({"sinks": 4, "selected_tokens": 2048, "boundary_trigger": False, "mode": mode}, use_env=False)
        lim = EngineLimits.for_engine(cfg, 8192, has_tokenizer=False)
        for extra in ({"sfi_preset": "balanced"}, {"sfi_boundary_trigger": 1}):
            if refused:
                with pytest.raises(SFIRequestError, match="needs sentence-ender token ids"):
                    resolve_request_config(lim, extra)
            else:
                assert resolve_request_config(lim, extra).boundary_trigger


def test_engine_settings_refuse_an_empty_ender_list_and_an_empty_stats_path():
    with pytest.raises(SFIConfigError, match="boundary_token_ids: an empty list"):
        build_config({"boundary_token_ids": []}, use_env=False)
    with pytest.raises(SFIConfigError, match="stats_file: String should have at least 1 character"):
        build_config({"stats_file": ""}, use_env=False)
