"""Plugin registration, the SFI alias, the CPU platform patch and the version gate (no engine)."""

import pytest

vllm = pytest.importorskip("vllm")

from sfi_vllm import plugin  # noqa: E402
from sfi_vllm.version import UnsupportedVLLMVersion, require_supported_vllm  # noqa: E402


def test_register_is_idempotent_and_adds_alias():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    plugin.register()
    plugin.register()
    assert E["SFI"] is E.CUSTOM and E["sfi".upper()] is E.CUSTOM
    assert "SFI" not in [m.name for m in E]  # an alias, not a new member
    assert E.CUSTOM.get_path() == plugin.CPU_BACKEND
    from vllm.config.attention import AttentionConfig

    assert AttentionConfig.validate_backend_before("sfi") is E.CUSTOM


def test_skipped_prefix_count_answers_zero_for_every_group():
    from types import SimpleNamespace

    from sfi_vllm.patches import prefix_count

    manager = SimpleNamespace(get_num_common_prefix_blocks=lambda rid: [99, 99])
    scheduler = SimpleNamespace(kv_cache_config=SimpleNamespace(kv_cache_groups=[object(), object()]),
                                kv_cache_manager=manager)
    before = prefix_count.skipped_schedulers()
    prefix_count.skip_count(scheduler)
    assert manager.get_num_common_prefix_blocks("any request") == [0, 0]
    assert prefix_count.skipped_schedulers() == before + 1


def test_prompt_window_leaves_that_many_prompt_tokens_out_of_cache_hits():
    from types import SimpleNamespace

    from sfi_vllm.patches.prompt_window import keep_prompt_window

    asked = []
    coordinator = SimpleNamespace(find_longest_cache_hit=lambda hashes, longest: asked.append(longest) or ("hit", longest))
    scheduler = SimpleNamespace(kv_cache_manager=SimpleNamespace(coordinator=coordinator))
    keep_prompt_window(scheduler, 32)
    assert coordinator.find_longest_cache_hit(["h"], 2174) == ("hit", 2143)  # 2175-token prompt: 32 left
    assert coordinator.find_longest_cache_hit([], 10) == ("hit", 0)
    assert asked == [2143, 0]
    unchanged = SimpleNamespace(kv_cache_manager=SimpleNamespace(coordinator=SimpleNamespace(find_longest_cache_hit=len)))
    keep_prompt_window(unchanged, 1)  # vLLM computes the last token anyway
    assert unchanged.kv_cache_manager.coordinator.find_longest_cache_hit is len


def test_scheduler_init_is_wrapped_once_an_engine_resolves_its_scheduler_class():
    from vllm.config.scheduler import SchedulerConfig

    plugin.register()  # installs sfi_vllm.patches.prefix_count
    cls = SchedulerConfig(max_model_len=1024, is_encoder_decoder=False).get_scheduler_cls()
    from vllm.v1.core.sched.scheduler import Scheduler

    assert issubclass(cls, Scheduler)
    assert Scheduler.__init__.__code__.co_filename.endswith("prefix_count.py")  # our wrapper, run for every engine


def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("sfi") == "sfi_vllm.plugin:register"


def _selector_config(**kw):
    import torch
    from vllm.v1.attention.selector import AttentionSelectorConfig

    base = dict(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=128)
    base.update(kw)
    return AttentionSelectorConfig(**base)


def test_cpu_platform_honours_custom_and_validates():
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    plugin.register()
    assert CpuPlatform.get_attn_backend_cls(E.CUSTOM, _selector_config()) == plugin.CPU_BACKEND
    assert "cpu_attn" in CpuPlatform.get_attn_backend_cls(None, _selector_config())
    with pytest.raises(ValueError, match="sliding window not supported"):
        CpuPlatform.get_attn_backend_cls(E.CUSTOM, _selector_config(has_sliding_window=True))
    with pytest.raises(ValueError, match="head_size not supported"):
        CpuPlatform.get_attn_backend_cls(E.CUSTOM, _selector_config(head_size=72))
    with pytest.raises(ValueError, match="kv_cache_dtype not supported"):
        CpuPlatform.get_attn_backend_cls(E.CUSTOM, _selector_config(kv_cache_dtype="fp8"))


def test_version_gate(monkeypatch):
    assert require_supported_vllm().startswith("0.27")
    monkeypatch.setattr(vllm, "__version__", "0.30.1")
    monkeypatch.setattr(vllm, "__version_tuple__", (0, 30, 1))
    with pytest.raises(UnsupportedVLLMVersion, match="supports vLLM 0.26 .* found vLLM 0.30.1"):
        require_supported_vllm()


def test_gpu_kernels_refuse_head_sizes_they_cannot_index():
    from sfi_vllm.backends.common import check_kernel_head_size

    for ok in (64, 128, 256, 32):
        check_kernel_head_size(ok)
    for bad in (80, 96, 112, 8):
        with pytest.raises(ValueError, match=f"head size.*this model's is {bad}.*kernels"):
            check_kernel_head_size(bad)


def test_sfi_info_records_reach_vllms_log_handlers():
    """vLLM configures handlers for its ``vllm`` logger only; our start-up INFO lines (buffer
    memory) must go through them, not to Python's last-resort handler (warnings only)."""
    import logging

    ours, theirs = logging.getLogger("sfi_vllm"), logging.getLogger("vllm")
    saved = (list(ours.handlers), ours.level, ours.propagate)
    records: list[logging.LogRecord] = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append(record)

    capture = Capture()
    theirs.addHandler(capture)
    try:
        ours.handlers.clear()
        plugin.register()
        assert capture in ours.handlers and not ours.propagate
        logging.getLogger("sfi_vllm.backends.cuda").info("sfi-vllm: buffers take %d MiB", 3)
        assert [r.getMessage() for r in records] == ["sfi-vllm: buffers take 3 MiB"]
        plugin.register()  # idempotent: no second copy of the handlers
        assert ours.handlers.count(capture) == 1
    finally:
        theirs.removeHandler(capture)
        ours.handlers[:] = saved[0]
        ours.setLevel(saved[1])
        ours.propagate = saved[2]
