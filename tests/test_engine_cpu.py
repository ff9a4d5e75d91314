"""Real vLLM (CPU) engines with and without SFI on the embedded SmolLM2-135M-Instruct.

One engine per configuration, each in its own process (see sfi_vllm.tools.engine_job), shared by the
tests through session fixtures. Prompts are a few hundred tokens (vLLM CPU prefills ~70-110
tokens/s on 2 cores). ``max_num_batched_tokens=256`` chunks the prefills, so decode rows of one
request share batches with prefill chunks of others (mixed batches).
"""

import os

import pytest

from sfi_vllm.config import SFIConfig

pytestmark = pytest.mark.engine

MAX_TOKENS = 48
ENGINE = dict(max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=256, dtype="float32")
FULL_BUDGET = {"sinks": 4, "recent_window": 64, "selected_tokens": 4096, "reuse_budget": 16, "min_gap": 4}
# bridge_steps 0: these tests follow the trigger from the first decode step (the bridge is tested
# in tests/test_trigger.py and tests/test_needle_default.py)
SMALL_BUDGET = {"sinks": 4, "recent_window": 32, "selected_tokens": 32, "reuse_budget": 12, "min_gap": 3,
                "bridge_steps": 0}
# tensor parallelism: SmolLM2 has 9 query / 3 KV heads, so 3 workers hold one KV head each.
# Cross-head exclusivity runs among a worker's own heads (skipped at <= 2), so the comparison with
# one worker turns it off on both sides.
TP = 3
# the tensor-parallel comparison's requests (3 workers on 2 cores generate slowly): 2 prompts, 32
# tokens each, enough for the first selection and a reuse-budget slow step in each
TP_PROMPTS, TP_TOKENS = 2, 32
NO_EXCLUSIVITY = {**SMALL_BUDGET, "selector": {"use_exclusivity": False}}


@pytest.fixture(scope="session")
def model_dir():
    from sfi_vllm.tools.model_prep import prepare_model

    return str(prepare_model(progress=False))


@pytest.fixture(scope="session")
def prompts(model_dir):
    from transformers import AutoTokenizer

    from sfi_vllm.tools.texts import long_prompts

    return long_prompts(AutoTokenizer.from_pretrained(model_dir), 3, 320, seed=7)


# schedulers in the engine's process that skip vLLM's per-step common-prefix count
SKIPPED_COUNTS = "sfi_vllm.patches.prefix_count:skipped_schedulers"


def _job(model_dir, prompts, env=None, max_tokens=MAX_TOKENS, **kw):
    from sfi_vllm.tools.engine_job import EngineJob, run_engine_job

    engine = dict(ENGINE, **kw.pop("engine", {}))
    return run_engine_job(EngineJob(model=model_dir, prompts=prompts, max_tokens=max_tokens,
                                    engine_kwargs=engine, collect=[SKIPPED_COUNTS], **kw), env=env, timeout=900)


@pytest.fixture(scope="session")
def dense(model_dir, prompts):
    return _job(model_dir, prompts)


@pytest.fixture(scope="session")
def sfi_full(model_dir, prompts):
    # phase 1 asks the same prompts again: their prefills are prefix-cache hits
    requests = [{"prompt": p, "phase": phase} for phase in (0, 1) for p in prompts]
    return _job(model_dir, None, requests=requests, attention_backend="sfi", sfi=FULL_BUDGET)


@pytest.fixture(scope="session")
def sfi_small(model_dir, prompts):
    # block size 16 here (the CPU default is 128, used by the other engines)
    return _job(model_dir, prompts, attention_backend="SFI", sfi=SMALL_BUDGET,
                engine={"block_size": 16})


@pytest.fixture(scope="session")
def sfi_no_exclusivity(model_dir, prompts):
    return _job(model_dir, prompts[:TP_PROMPTS], max_tokens=TP_TOKENS, attention_backend="sfi", sfi=NO_EXCLUSIVITY,
                engine={"block_size": 16})


@pytest.fixture(scope="session")
def sfi_tensor_parallel(model_dir, prompts):
    # vLLM CPU binds each worker's OpenMP threads to one entry of a '|'-separated list
    cores = os.cpu_count() or 1
    env = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i % cores) for i in range(TP))}
    return _job(model_dir, prompts[:TP_PROMPTS], env=env, max_tokens=TP_TOKENS, attention_backend="sfi", sfi=NO_EXCLUSIVITY,
                engine={"block_size": 16, "tensor_parallel_size": TP, "distributed_executor_backend": "mp"})


@pytest.fixture(scope="session")
def sfi_full_preempted(model_dir, prompts):
    # 7 KV blocks of 128 tokens: two of the ~340-token prompts fit with one block to spare, so when
    # both need a fourth block one preempts the other (recomputed later)
    return _job(model_dir, prompts, attention_backend="sfi", sfi=FULL_BUDGET,
                engine={"max_model_len": 512, "num_gpu_blocks_override": 7})


def _stats(result, out):
    st = result["sfi_stats"].get(out["request_id"])
    assert st is not None, f"no SFI statistics for {out['request_id']}"
    return st


def test_full_budget_sfi_is_token_identical_to_dense(dense, sfi_full):
    for d, s in zip(dense["outputs"], sfi_full["outputs"]):
        assert len(d["token_ids"]) == MAX_TOKENS
        assert s["token_ids"] == d["token_ids"]
        st = _stats(sfi_full, s)
        assert st["fast_steps"] > 0  # the fast path ran, and matched dense
        assert st["attended_fraction"] == pytest.approx(1.0)


def test_only_sfi_engines_skip_the_schedulers_common_prefix_count(dense, sfi_full):
    # the count serves cascade attention, which the SFI backend never uses (sfi_vllm.patches.prefix_count)
    assert dense["collected"][SKIPPED_COUNTS] == 0
    assert sfi_full["collected"][SKIPPED_COUNTS] == 1


def test_sfi_really_runs_with_a_small_budget(sfi_small):
    boundary_events = 0
    for out in sfi_small["outputs"]:
        assert out["finish_reason"] in ("length", "stop") and out["text"].strip()
        st = _stats(sfi_small, out)
        assert st["decode_steps"] == len(out["token_ids"]) - 1
        assert st["fast_steps"] > 0 and st["slow_steps"] > 0 and st["dense_steps"] == 0
        assert st["slow_events"][0][0] == 0 and st["slow_events"][0][2] == "first_decode"
        assert st["mean_attended_per_fast_step"] < st["mean_context_per_fast_step"]
        boundary_events += st["slow_reasons"].get("boundary", 0)
    assert boundary_events > 0, "no slow step fired at a sentence boundary"


def test_small_budget_statistics_match_the_configuration(sfi_small):
    cfg = SMALL_BUDGET
    assert SFIConfig().reuse_stagger  # the default, which these engines run
    enders, skips = set(sfi_small["boundary_enders"]), set(sfi_small["boundary_skips"])
    assert enders
    shortened = 0  # first intervals that the budget ended, shorter than the budget
    for out in sfi_small["outputs"]:
        st = _stats(sfi_small, out)
        toks = out["token_ids"]
        steps = [e[0] for e in st["slow_events"]]
        assert len(steps) == st["slow_steps"]
        assert st["slow_events"][0][2] == "first_decode"
        # reuse_stagger (the default): the interval after the first selection is shorter by an
        # offset that follows from the context length at that selection and the prompt's tokens
        # (sfi_vllm.trigger.reuse_offset), which the statistics report
        assert 0 <= st["reuse_offset"] < cfg["reuse_budget"]
        first_interval = cfg["reuse_budget"] - st["reuse_offset"]
        for i, (step, context, reason) in enumerate(st["slow_events"]):
            assert context == out["prompt_tokens"] + step + 1
            if i == 0:
                continue
            fast_between = step - steps[i - 1] - 1
            budget = first_interval if i == 1 else cfg["reuse_budget"]
            assert fast_between <= budget
            if reason == "reuse_budget":
                assert fast_between == budget
                shortened += i == 1 and budget < cfg["reuse_budget"]
            elif reason == "boundary":
                assert fast_between >= cfg["min_gap"]
                # decode step s reads token s (the one sampled before it): it is not whitespace,
                # and the last non-whitespace token before it ends a sentence
                assert toks[step] not in skips
                j = step - 1
                while j >= 0 and toks[j] in skips and toks[j] not in enders:
                    j -= 1
                assert j >= 0 and toks[j] in enders, (step, toks[max(0, step - 3): step + 1])
            else:
                pytest.fail(f"unexpected slow-step reason {reason}")
        # a fast step attends to sinks + K + window (window grows by one per fast step)
        bound = cfg["sinks"] + cfg["selected_tokens"] + cfg["recent_window"] + 16 + cfg["reuse_budget"]
        assert 0 < st["mean_attended_per_fast_step"] <= bound
        assert st["attended_fraction"] < 0.5
    assert shortened, "no request's first budget interval was shortened: the stagger was not exercised"


def test_tensor_parallel_workers_match_one_worker(sfi_no_exclusivity, sfi_tensor_parallel):
    """Three tensor-parallel workers (one KV head each, their own SFI controllers) generate what
    one worker does, every worker plans the same slow and fast steps, and the selection ran."""
    by_rank = sfi_tensor_parallel["sfi_stats_by_rank"]
    assert len(by_rank) == TP
    assert len(sfi_tensor_parallel["outputs"]) == len(sfi_no_exclusivity["outputs"]) == TP_PROMPTS
    for one, tp in zip(sfi_no_exclusivity["outputs"], sfi_tensor_parallel["outputs"]):
        assert tp["token_ids"] == one["token_ids"]
        st_one, st_tp = _stats(sfi_no_exclusivity, one), _stats(sfi_tensor_parallel, tp)
        # the first selection and at least one re-selection after it
        assert st_tp["fast_steps"] > 0 and st_tp["slow_steps"] >= 2
        assert st_tp["mean_attended_per_fast_step"] < st_tp["mean_context_per_fast_step"]
        for key in ("slow_events", "fast_steps", "decode_steps"):
            assert st_tp[key] == st_one[key], key
            assert all(rank[tp["request_id"]][key] == st_tp[key] for rank in by_rank), key


def test_preemption_keeps_full_budget_sfi_identical_to_dense(dense, sfi_full_preempted):
    """A preempted request's SFI state is reset and rebuilt from its recomputed prefill:
    full-budget SFI still generates exactly what dense attention does without preemption."""
    res = sfi_full_preempted
    assert sum(_stats(res, o)["preemptions"] for o in res["outputs"]) > 0, "no request was preempted"
    for d, s in zip(dense["outputs"], res["outputs"]):
        assert s["token_ids"] == d["token_ids"]
        assert _stats(res, s)["fast_steps"] > 0


def test_requests_below_dense_below_context_leave_the_compact_pool_to_others(model_dir, prompts, dense):
    """A pool of one compact set and three requests whose contexts stay below dense_below_context
    (prompt + max_tokens, ~370 of 1,024 tokens): none takes a set, so none falls back for a full
    pool; each decodes densely through the SFI backend and gives dense's tokens."""
    from sfi_vllm.compact_pool import compact_bytes_per_slot
    from sfi_vllm.config import build_config

    one_set = compact_bytes_per_slot(30, 3, build_config({}, use_env=False).compact_capacity(1024), 64, 4, False)
    res = _job(model_dir, prompts, attention_backend="sfi",
               sfi={"compact_memory_gib": 1.5 * one_set / 2**30, "dense_below_context": 1024})
    for d, s in zip(dense["outputs"], res["outputs"]):
        st = _stats(res, s)
        assert st["fallback"] is None and st["policy"] == "sfi"
        assert st["dense_steps"] == st["decode_steps"] == MAX_TOKENS - 1
        assert s["token_ids"] == d["token_ids"]


def test_prefix_cache_hits_keep_full_budget_sfi_identical_to_dense(dense, sfi_full):
    """A request whose prompt comes from the prefix cache starts from a partial prefill; full-budget
    SFI still generates exactly what dense attention does."""
    n = len(dense["outputs"])
    again = sfi_full["outputs"][n:]
    assert len(again) == n and all(o["cached_tokens"] for o in again), [o["cached_tokens"] for o in again]
    for d, s in zip(dense["outputs"], again):
        assert s["token_ids"] == d["token_ids"]
        assert _stats(sfi_full, s)["fast_steps"] > 0
