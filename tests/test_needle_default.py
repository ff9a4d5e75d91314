"""The default selection keeps a single-needle answer that dense attention finds.

Two niah_single samples of the quality suite at a 4K context (about 3,900 prompt tokens, so the
default working set of sinks + K + window = 2,308 tokens holds about 60% of it) through a real CPU
engine (float32, greedy), dense first, then the engine's default ``sfi`` and the paper's Selector
on the prefix-cached prompt. SmolLM2 restates the question before it writes the number ("The
special magic number for smooth-oyster is 7294538."); a selection frozen at the first decode step
misses the needle, and a token-level one splits the number. Both samples were chosen because the
paper's Selector loses them while dense finds them (asserted too, so the case keeps discriminating:
if it stops doing so, pick other samples rather than loosening the check).
"""

import pytest

pytestmark = pytest.mark.engine

CONTEXT = 4096
SUITE_SAMPLES = 6  # the needle depths depend on the number of samples drawn
CASES = (4, 5)


@pytest.fixture(scope="module")
def outputs():
    from transformers import AutoTokenizer

    from sfi_vllm.tools.engine_job import EngineJob, cpu_engine_env, run_engine_job
    from sfi_vllm.tools.model_prep import prepare_model
    from sfi_vllm.tools.policies import policy_overrides
    from sfi_vllm.tools.quality.tasks import make_samples, score

    model = str(prepare_model(progress=False))
    samples = make_samples(AutoTokenizer.from_pretrained(model), "niah_single", CONTEXT, SUITE_SAMPLES)
    policies = ("dense", "sfi", "sfi-paper")
    requests, keys = [], []
    for i in CASES:
        smp = samples[i]
        root = len(requests)
        for pol in policies:
            req = dict(max_tokens=smp.max_new_tokens, sfi=policy_overrides(pol, None, CONTEXT))
            if pol == "dense":
                req["prompt"] = smp.prompt
            else:
                req["after"] = root
            requests.append(req)
            keys.append((i, pol))
    job = EngineJob(model=model, requests=requests, attention_backend="sfi", max_open=1,
                    engine_kwargs=dict(max_model_len=CONTEXT, max_num_seqs=4, dtype="float32",
                                       enable_prefix_caching=True))
    res = run_engine_job(job, env=cpu_engine_env(2), timeout=1200)
    out = {}
    for (i, pol), o in zip(keys, res["outputs"]):
        st = res["sfi_stats"].get(o["request_id"], {})
        out[(i, pol)] = dict(text=o["text"], score=score(samples[i], o["text"]), stats=st,
                             prompt_tokens=o["prompt_tokens"])
    return out


@pytest.mark.parametrize("case", CASES)
def test_default_sfi_finds_the_needle_that_dense_finds(outputs, case):
    dense, sfi, paper = (outputs[(case, p)] for p in ("dense", "sfi", "sfi-paper"))
    assert dense["prompt_tokens"] > 2308 + 1000  # the working set holds well under the context
    assert dense["score"] == 1.0, dense["text"]
    assert paper["score"] == 0.0, f"the case no longer discriminates: {paper['text']!r}"
    assert sfi["score"] == 1.0, (sfi["text"], dense["text"])
    st = sfi["stats"]
    assert st["fast_steps"] > 0 and st["slow_steps"] >= 1 and st["config_error"] is None
    assert 0.0 < st["attended_fraction"] < 0.7  # the fast steps read the working set, not the context
