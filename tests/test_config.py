import pytest

from sfi_vllm.config import PRESETS, SFIConfigError, build_config, config_from_vllm, preset_values


@pytest.mark.parametrize("name", PRESETS)
def test_presets_load_and_validate(name):
    cfg = build_config({"preset": name}, use_env=False)
    for key, value in preset_values(name).items():
        if isinstance(value, dict):  # the nested selector settings, field by field
            for sub, v in value.items():
                assert getattr(getattr(cfg, key), sub) == v, (key, sub)
        else:
            assert getattr(cfg, key) == value


def test_override_beats_preset_and_file(tmp_path, monkeypatch):
    f = tmp_path / "sfi.yaml"
    f.write_text("preset: speed\nreuse_budget: 40\nsinks: 8\n")
    monkeypatch.setenv("SFI_CONFIG", str(f))
    cfg = build_config({"sinks": 2})
    assert (cfg.preset, cfg.reuse_budget, cfg.sinks, cfg.selected_tokens) == ("speed", 40, 2, 2048)


def test_fraction_budget_with_floor_and_cap():
    cfg = build_config({"preset": "balanced", "selected_fraction": 0.1, "selected_floor": 100,
                        "selected_cap": 500}, use_env=False)
    assert cfg.selected_tokens is None
    assert [cfg.selected_budget(n) for n in (500, 2000, 9000)] == [100, 200, 500]


@pytest.mark.parametrize(
    "bad,needle",
    [
        ({"sinks": -1}, "sfi.sinks"),
        ({"recent_window": 0}, "1 <= value"),
        ({"selected_fraction": 1.5}, "sfi.selected_fraction"),
        ({"selected_tokens": 10, "selected_fraction": 0.2}, "not both"),
        ({"min_gap": 100}, "min_gap (100) must be <= reuse_budget (64)"),
        ({"selector": {"alpha": 0}}, "sfi.selector.alpha"),
        ({"bogus": 1}, "sfi.bogus"),
        ({"preset": "fast"}, "unknown preset"),
        ({"selected_floor": 10, "selected_cap": 5, "selected_fraction": 0.1}, "selected_floor"),
        ({"slow_refresh": "per_token"}, "sfi.slow_refresh"),
        ({"slow_in_graph": True, "slow_refresh": "per_layer"}, "slow_in_graph needs the per-step refresh"),
        ({"fused_scores_tokens": 8192, "slow_in_graph": False}, "fused_scores_tokens needs slow steps inside"),
        ({"fused_scores_tokens": 8192, "kernels": "torch"}, "fused_scores_tokens needs slow steps inside"),
        ({"fused_scores_tokens": -1}, "sfi.fused_scores_tokens"),
        ({"fused_scores_tokens": "max"}, "sfi.fused_scores_tokens"),
        ({"experimental": {"selector_top_k": "cub"}}, "sfi.experimental.selector_top_k"),
        ({"selector_top_k": "triton"}, "sfi.selector_top_k moved to sfi.experimental.selector_top_k"),
        ({"experimental": {"one_wave_splits": True}}, "experimental.one_wave_splits needs balanced_splits false"),
        ({"experimental": {"balanced_splits": False}}, "experimental.balanced_splits moved to sfi.balanced_splits"),
        ({"boundary_token_ids": [13, -1]}, "token ids are 0 or more; got [13, -1]"),
        # a number too large for an integer is not called a string (pydantic's own wording)
        ({"selected_tokens": 1e30}, "sfi.selected_tokens: Input should be an integer (allowed: 0 <= value"),
    ],
)
def test_bad_values_name_the_field(bad, needle):
    with pytest.raises(SFIConfigError, match=None) as e:
        build_config(bad, use_env=False)
    assert needle in str(e.value)


def test_min_gap_bounds_the_reuse_budget_in_the_lossy_mode_only():
    # lossless drafting has no min_gap (its drafter re-selects at a verify or at the reuse budget)
    assert build_config({"mode": "lossless", "reuse_budget": 8}, use_env=False).reuse_budget == 8
    with pytest.raises(SFIConfigError, match=r"min_gap \(16\) must be <= reuse_budget \(8\)"):
        build_config({"reuse_budget": 8}, use_env=False)


def test_prompt_window_serves_the_lossy_mode_only():
    assert build_config({"experimental": {"prompt_window": 32}}, use_env=False).experimental.prompt_window == 32
    with pytest.raises(SFIConfigError, match="prompt_window .* lossy mode"):
        build_config({"mode": "lossless", "experimental": {"prompt_window": 32}}, use_env=False)


def test_slow_in_graph_resolves_where_the_refresh_allows_it():
    # unset (the default): on with the per-step refresh, off where the settings exclude it, no error
    assert build_config({}, use_env=False).graph_slow_enabled
    assert not build_config({"slow_refresh": "per_layer"}, use_env=False).graph_slow_enabled
    assert not build_config({"layer_interleaved_refresh": True}, use_env=False).graph_slow_enabled
    assert not build_config({"slow_in_graph": False}, use_env=False).graph_slow_enabled
    assert build_config({"slow_in_graph": True, "slow_refresh": "per_step"}, use_env=False).graph_slow_enabled
    with pytest.raises(SFIConfigError, match="slow_in_graph needs"):
        build_config({"slow_in_graph": True, "layer_interleaved_refresh": True}, use_env=False)


def test_fused_scores_tokens_auto_is_bounded_by_bytes_gpu_share_and_the_longest_batch():
    from sfi_vllm.config import FUSED_AUTO_BYTES

    cfg = build_config({}, use_env=False)
    assert cfg.fused_scores_tokens == "auto"
    qwen3_4b = (36, 32, 8)  # layers, query heads, KV heads: 5,760 bytes per frame token
    h200, gpu24 = int(139.8 * 2**30), 24 << 30  # total memory as torch reports it
    assert cfg.fused_tokens_for(*qwen3_4b, 256, 32768, h200) == FUSED_AUTO_BYTES // 5760 == 372827
    # a small GPU: 2% of its memory
    assert cfg.fused_tokens_for(*qwen3_4b, 256, 32768, gpu24) == int(0.02 * gpu24) // 5760 == 89478
    # a small engine: every sequence at the longest context, rounded up to the 2048-token frame
    assert cfg.fused_tokens_for(*qwen3_4b, 8, 30000, h200) == 8 * 30720
    # an explicit size is used as given; 0 and the settings without graph slow steps turn it off
    explicit = build_config({"fused_scores_tokens": 4096}, use_env=False)
    assert explicit.fused_tokens_for(*qwen3_4b, 8, 30000, gpu24) == 4096
    assert build_config({"fused_scores_tokens": 0}, use_env=False).fused_tokens_for(*qwen3_4b, 8, 30000, h200) == 0
    for off in ({"kernels": "torch"}, {"slow_in_graph": False}, {"slow_refresh": "per_layer"}):
        assert build_config(off, use_env=False).fused_tokens_for(*qwen3_4b, 8, 30000, h200) == 0


def test_from_vllm_additional_config():
    class V:
        additional_config = {"sfi": {"preset": "speed", "reuse_budget": 30}}

    cfg = config_from_vllm(V())
    assert cfg.bridge_steps == 0 and not cfg.boundary_trigger and cfg.reuse_budget == 30

    class Bad:
        additional_config = {"sfi": [1, 2]}

    with pytest.raises(SFIConfigError, match="JSON object"):
        config_from_vllm(Bad())


@pytest.mark.parametrize("key", ["SFI", "Sfi", "sfi-vllm", "sfi_vllm", " sfi"])
def test_a_misspelt_sfi_key_in_additional_config_is_refused(key):
    """Settings under a key that is not exactly ``sfi`` would be ignored: start-up stops instead;
    other extensions' keys pass."""
    class V:
        additional_config = {key: {"policy": "dense"}, "sfinder": {"x": 1}}

    with pytest.raises(SFIConfigError, match=f"{key!r} is not SFI's key"):
        config_from_vllm(V())

    class Other:
        additional_config = {"sfinder": {"x": 1}, "sfi": {"reuse_budget": 30}}

    assert config_from_vllm(Other()).reuse_budget == 30


def test_slow_refresh_auto_picks_per_step_up_to_the_measured_bound():
    from sfi_vllm.backends.step_refresh import AUTO_MAX_TOKENS, refresh_per_step

    assert build_config({}, use_env=False).slow_refresh == "auto"
    # the measured points (e2e-h200.md): 8 x 32K per step, 6 x 128K per layer
    assert refresh_per_step("auto", [32768] * 8) and refresh_per_step("auto", [131072])
    assert not refresh_per_step("auto", [131072] * 6)
    assert refresh_per_step("auto", [AUTO_MAX_TOKENS]) and not refresh_per_step("auto", [AUTO_MAX_TOKENS, 1])
    assert refresh_per_step("per_step", [131072] * 6) and not refresh_per_step("per_layer", [10])
    # keys-only rows (slow_attention keys) take the per-step refresh at any size (6 x 128K measured)
    assert refresh_per_step("auto", [131072] * 6, keys_only=True)
    assert not refresh_per_step("per_layer", [10], keys_only=True)


def test_a_removed_preset_says_what_to_set_instead():
    with pytest.raises(SFIConfigError, match=r"allowed: balanced, speed, paper \('quality' was removed.*bridge_steps"):
        build_config({"preset": "quality"}, use_env=False)
    with pytest.raises(SFIConfigError, match="unknown preset 'fastest'; allowed: balanced, speed, paper$"):
        build_config({"preset": "fastest"}, use_env=False)


def test_speed_preset_is_the_measured_benchmark_setting():
    """The speed preset is what benchmarks/e2e_bench.py times: the default selection without the
    bridge and the boundary trigger, with a reuse budget of 20 (the quality suite's policy
    ``sfi-reuse-20`` plus ``bridge_steps`` 0). So it keeps slow steps inside CUDA graphs and the
    fused slow-step scores (no layer interleaving)."""
    from sfi_vllm.tools.policies import policy_overrides

    measured = build_config({"boundary_trigger": False, "reuse_budget": 20, "bridge_steps": 0}, use_env=False)
    cfg = build_config({"preset": "speed"}, use_env=False)
    assert cfg.model_dump(exclude={"preset"}) == measured.model_dump(exclude={"preset"})
    assert build_config({**policy_overrides("sfi-reuse-20", 0, 4096), "bridge_steps": 0}, use_env=False).model_dump(
        exclude={"preset"}) == measured.model_dump(exclude={"preset"})
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import e2e_bench

    assert e2e_bench.SFI == {"preset": "speed"}  # what the benchmark times
    assert cfg.graph_slow_enabled and not cfg.layer_interleaved_refresh and cfg.fused_scores_tokens == "auto"


ENGINE_FIELDS = ("mode", "newline_is_boundary", "boundary_token_ids", "boundary_read", "kernels", "side_stream",
                 "refresh_overlap",
                 "slow_refresh", "slow_in_graph", "fused_scores_tokens", "drafter_graphs", "drafter_kv", "balanced_splits", "experimental", "compact_memory_gib",
                 "stats_file")


def test_engine_settings_and_policy_split_sfi_config():
    """SFIConfig is EngineSettings and Policy, disjoint, with nothing of its own; the engine-wide
    fields (the README's ``engine`` rows, refused per request) are EngineSettings'."""
    from sfi_vllm.config import EngineSettings, Policy, SFIConfig, engine_fields

    engine, policy = set(EngineSettings.model_fields), set(Policy.model_fields)
    assert not engine & policy
    assert engine | policy == set(SFIConfig.model_fields)
    assert tuple(SFIConfig.model_fields) == (*Policy.model_fields, *EngineSettings.model_fields)
    assert engine_fields() == tuple(EngineSettings.model_fields) == ENGINE_FIELDS
    assert {"preset", "policy", "sinks", "selected_tokens", "selector", "layer_interleaved_refresh"} <= policy
    for name, field in SFIConfig.model_fields.items():  # descriptions and constraints come through
        half = EngineSettings if name in engine else Policy
        assert (field.description, field.metadata, field.annotation) == (
            half.model_fields[name].description, half.model_fields[name].metadata, half.model_fields[name].annotation)


def test_a_policy_refuses_an_engine_field_by_name_and_the_halves_round_trip():
    from pydantic import ValidationError

    from sfi_vllm.config import EngineSettings, Policy, SFIConfig

    for key in ENGINE_FIELDS:
        with pytest.raises(ValidationError, match=rf"sfi\.{key} is an engine-wide setting \(EngineSettings\)"):
            Policy.model_validate({key: None})
    with pytest.raises(ValidationError, match=r"sfi\.sinks is a per-request setting \(Policy\)"):
        EngineSettings(sinks=2)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        Policy(sinkz=2)
    with pytest.raises(ValidationError, match="sfi.selector_top_k moved to sfi.experimental.selector_top_k"):
        EngineSettings(selector_top_k="torch")
    # Policy's own checks hold without the engine half; the ones across halves are SFIConfig's
    assert Policy().selected_tokens == 2048 and Policy(selected_fraction=0.1).selected_tokens is None
    with pytest.raises(ValidationError, match="not both"):
        Policy(selected_tokens=10, selected_fraction=0.1)
    Policy(layer_interleaved_refresh=True)
    EngineSettings(slow_in_graph=True)
    with pytest.raises(ValidationError, match="slow_in_graph needs"):
        SFIConfig(slow_in_graph=True, layer_interleaved_refresh=True)
    cfg = build_config({"preset": "paper", "kernels": "torch", "sinks": 8, "boundary_token_ids": [3]}, use_env=False)
    engine, policy = cfg.engine_settings(), cfg.policy_settings()
    assert (type(engine), type(policy)) == (EngineSettings, Policy)
    assert (engine.kernels, policy.sinks, policy.preset, policy.selector.page_size) == ("torch", 8, "paper", 0)
    assert SFIConfig(**dict(engine), **dict(policy)) == cfg


@pytest.mark.parametrize("name", PRESETS)
def test_presets_set_policy_fields_only(name):
    """A request may name a preset, so a preset must not reach an engine-wide field."""
    from sfi_vllm.config import Policy

    assert set(preset_values(name)) <= set(Policy.model_fields) - {"preset"}


def test_a_layer_gives_the_budget_in_one_form_over_the_other(tmp_path, monkeypatch):
    """preset < $SFI_CONFIG < overrides: a layer's K replaces a fraction below it and the other
    way round (a K in --additional-config over a file's fraction was refused as both forms)."""
    monkeypatch.setenv("SFI_CONFIG", str(tmp_path / "sfi.yaml"))
    (tmp_path / "sfi.yaml").write_text("selected_fraction: 0.1\n")
    cfg = build_config({"selected_tokens": 512})
    assert (cfg.selected_tokens, cfg.selected_fraction) == (512, None)
    assert build_config({}).selected_fraction == 0.1
    (tmp_path / "sfi.yaml").write_text("preset: speed\nselected_fraction: 0.2\n")  # over the preset's K
    assert (build_config({}).selected_tokens, build_config({}).selected_fraction) == (None, 0.2)
    (tmp_path / "sfi.yaml").write_text("selected_tokens: 256\n")
    cfg = build_config({"selected_fraction": 0.3})
    assert (cfg.selected_tokens, cfg.selected_fraction) == (None, 0.3)
    with pytest.raises(SFIConfigError, match="not both"):  # both forms in one layer contradict
        build_config({"selected_tokens": 512, "selected_fraction": 0.3})


def test_a_long_unknown_key_is_cut_in_the_message():
    for bad in ({"k" * 400: 1}, {"selector": {"k" * 400: 1}}):
        with pytest.raises(SFIConfigError) as info:
            build_config(bad, use_env=False)
        assert "...(400 characters): Extra inputs are not permitted" in str(info.value)
        assert len(str(info.value)) < 200, str(info.value)
