"""Teacher-forced fidelity: the forcing logits processor, the metric's bookkeeping, and (engine
tests) forcing through a real vLLM CPU engine, where dense forced on its own greedy tokens must
agree with itself (top-1 1.0, KL ~0)."""

import json
from types import SimpleNamespace

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from sfi_vllm.tools.quality import forcing
from sfi_vllm.tools.quality.fidelity import build_requests, raw_check, repeated_steps, summarize
from sfi_vllm.tools.quality.forcing import STORE, ForceTokens, collect, compare

V = 50


@pytest.fixture(autouse=True)
def clean_store():
    STORE.clear()
    yield
    STORE.clear()


def proc():
    return ForceTokens(SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: V)), torch.device("cpu"), False)


def params(**force):
    return SamplingParams(temperature=0.0, max_tokens=8, extra_args={"force": force} if force else None)


def update(added=(), removed=(), moved=(), size=4):
    return BatchUpdate(batch_size=size, removed=list(removed), added=list(added), moved=list(moved))


def test_processor_forces_exactly_and_leaves_other_rows_alone(rng):
    p = proc()
    outs = [[], [], [3]]
    p.update_state(update(added=[(0, params(tokens=[7, 8, 9]), [1], outs[0]),
                                 (1, params(), [1], outs[1]),  # no forcing
                                 (2, params(tokens=[5, 6]), [1], outs[2])], size=3))
    for step in range(3):
        logits = torch.randn(3, V, generator=rng)
        orig = logits.clone()
        got = p.apply(logits)
        row0 = got[0]
        assert int(row0.argmax()) == [7, 8, 9][step]
        assert torch.isinf(row0).sum() == V - 1 and row0[[7, 8, 9][step]] == 0
        assert torch.equal(got[1], orig[1])
        if len(outs[2]) < 2:  # step = tokens produced so far: 1 -> forced 6
            assert int(got[2].argmax()) == 6 and torch.isinf(got[2]).sum() == V - 1
        else:  # past the forced tokens: untouched
            assert torch.equal(got[2], orig[2])
        for o, row in zip(outs, got):
            o.append(int(row.argmax()))
    assert outs[0] == [7, 8, 9] and outs[2][:2] == [3, 6]


def test_processor_follows_moves_swaps_and_removals(rng):
    p = proc()
    a, b = [], []
    p.update_state(update(added=[(0, params(tokens=[1, 1, 1]), None, a), (1, params(tokens=[2, 2, 2]), None, b)], size=2))
    p.update_state(update(moved=[(0, 1, MoveDirectionality.SWAP)], size=2))
    got = p.apply(torch.randn(2, V, generator=rng))
    assert int(got[0].argmax()) == 2 and int(got[1].argmax()) == 1
    p.update_state(update(removed=[0], moved=[(1, 0, MoveDirectionality.UNIDIRECTIONAL)], size=1))
    got = p.apply(torch.randn(1, V, generator=rng))
    assert int(got[0].argmax()) == 1 and list(p.rows) == [0]


def test_validate_params():
    ForceTokens.validate_params(params(tokens=[1, 2]))
    ForceTokens.validate_params(params())
    with pytest.raises(ValueError):
        ForceTokens.validate_params(params(tokens=[1, -2]))
    with pytest.raises(ValueError):
        ForceTokens.validate_params(params(tokens=[1], save_ref="a", ref="a"))
    with pytest.raises(ValueError):
        ForceTokens.validate_params(SamplingParams(temperature=0.7, extra_args={"force": {"tokens": [1]}}))


def test_compare_is_the_full_vocabulary_kl(rng):
    r = torch.log_softmax(torch.randn(V, generator=rng), -1)
    q = torch.log_softmax(torch.randn(V, generator=rng), -1)
    rec = compare(r, q, forced=3)
    brute = sum(float(r[i].exp()) * (float(r[i]) - float(q[i])) for i in range(V))
    assert rec["kl"] == pytest.approx(brute, rel=1e-6)
    assert rec["top1"] == int(q.argmax()) and rec["ref_top1"] == int(r.argmax())
    assert rec["forced_logp"] == pytest.approx(float(q[3])) and rec["ref_forced_logp"] == pytest.approx(float(r[3]))
    assert compare(r, r.clone(), None)["kl"] == 0.0


def test_records_against_a_reference_in_either_order(rng):
    """The policy run may be seen before its reference (same batch): compared in collect()."""
    p = proc()
    ref_out, pol_out = [], []
    toks = [4, 5, 6]
    p.update_state(update(added=[(0, params(tokens=toks, tag="pol", ref="d0"), None, pol_out),
                                 (1, params(tokens=toks, tag="r", save_ref="d0"), None, ref_out)], size=2))
    logits_seen = []
    for step in range(3):
        logits = torch.randn(2, V, generator=rng)
        logits_seen.append(logits.clone())
        p.apply(logits)
        pol_out.append(toks[step])
        ref_out.append(toks[step])
    got = collect()
    assert got["missing_ref"] == [] and set(got["tags"]) == {"pol", "r"}
    for step, lg in enumerate(logits_seen):
        want = compare(torch.log_softmax(lg[1], -1), torch.log_softmax(lg[0], -1), toks[step])
        rec = got["tags"]["pol"][step]
        assert rec["forced"] == toks[step] and rec["kl"] == pytest.approx(want["kl"])
        assert rec["top1"] == want["top1"] and rec["ref_top1"] == want["ref_top1"]
        assert got["tags"]["r"][step]["top1"] == int(lg[1].argmax())
    assert not STORE.steps and not STORE.refs  # cleared


def test_a_step_seen_twice_keeps_the_last_sighting(rng):
    """A chunked prefill's partial rows are discarded by vLLM; the last step-0 record wins."""
    p = proc()
    out = []
    p.update_state(update(added=[(0, params(tokens=[1, 2], tag="t"), None, out)], size=1))
    p.apply(torch.zeros(1, V))
    last = torch.randn(1, V, generator=rng)
    p.apply(last.clone())
    assert collect()["tags"]["t"][0]["top1"] == int(last[0].argmax())


def test_build_requests_phases_and_forcing_sources():
    prompts = {512: ["a", "b"]}
    reqs, keys = build_requests(prompts, ["dense", "sfi"], [0.1, 0.2], tokens=8)
    kinds = [k[0] for k in keys]
    assert kinds.count("free-dense") == 2 and kinds.count("ref") == 2
    assert kinds.count("forced") == 2 + 4 and kinds.count("free") == 4
    for r, k in zip(reqs, keys):
        assert r["phase"] == {"free-dense": 0, "ref": 1, "forced": 2, "free": 2}[k[0]]
        if k[0] in ("ref", "forced"):
            src = r["force_from"]
            assert keys[src][0] == "free-dense" and keys[src][1:3] == k[1:3]
            assert reqs[src]["prompt"] == r["prompt"]  # forced through decode, not the prompt
            assert "max_tokens" not in r  # as many as the forced tokens
        else:
            assert r["max_tokens"] == 9 and "force_from" not in r
    assert reqs[keys.index(("forced", 512, 1, "sfi", 0.2))]["sfi"]["selected_tokens"] > 0


def test_raw_check_and_summary():
    steps = [{"top1": 3}, {"top1": 4}]
    assert raw_check(steps, [{"3": -0.1, "9": -2.0}, {"4": -1.0, "5": -0.5}]) == 1
    assert raw_check(steps, [{"3": -0.1}, {"5": -0.5, "4": -0.5}]) == 0  # tie
    ref = dict(kind="ref", context=64, doc=0, self_top1=[1, 1, 1])
    forced = dict(kind="forced", policy="sfi", retention=0.1, context=64, doc=0, prompt_tokens=40,
                  top1=[1, 0], kl=[0.0, 0.4], nll_delta=[0.0, 0.2], fast_steps=2, slow_steps=0,
                  decode_steps=2, attended_fraction=0.25, raw_check_mismatches=0)
    free = dict(kind="free", policy="sfi", retention=0.1, context=64, doc=0, agree_tokens=1, possible_tokens=2)
    (row,) = summarize([ref, forced, free], tokens=2)
    assert row["top1_agreement"] == 0.5 and row["kl_mean"] == pytest.approx(0.2)
    assert row["n_steps"] == 2 and row["ref_self_top1"] == 1.0 and row["free_agree_tokens"] == 1.0
    assert row["free_identical"] == 0.0 and "full vocabulary" in row["kl_method"]
    assert "top1_fresh" not in row  # no dense continuation to find repeats in
    dense = dict(kind="free-dense", context=64, doc=0, token_ids=[5, 6, 7])
    (row,) = summarize([dense, ref, forced, free], tokens=2)
    assert row["n_fresh_steps"] == 2 and row["top1_fresh"] == 0.5 and row["kl_mean_fresh"] == pytest.approx(0.2)


def test_repeated_steps():
    ids = [1, 2, 3, 4, 2, 3, 4, 5, 3, 4]
    #              steps: 1  2  3  4  5  6  7  8  9
    assert repeated_steps(ids, n=2) == [False, False, False, False, True, True, False, False, True]
    assert repeated_steps(ids, n=3) == [False, False, False, False, False, True, False, False, False]
    assert repeated_steps([7] * 12) == [False] * 7 + [True] * 4


# --------------------------------------------------------------------------- real engine

ENGINE = dict(max_model_len=1024, max_num_seqs=4, dtype="float32")


@pytest.fixture(scope="module")
def model_dir():
    from sfi_vllm.tools.model_prep import prepare_model

    return str(prepare_model(progress=False))


@pytest.mark.engine
def test_engine_forces_arbitrary_tokens_and_records_raw_logprobs(model_dir):
    """Force a sequence greedy decoding would not produce; the recorded distribution is vLLM's raw
    one (equal to its own logprobs, computed before logits processors)."""
    from transformers import AutoTokenizer

    from sfi_vllm.tools.engine_job import EngineJob, run_engine_job

    tok = AutoTokenizer.from_pretrained(model_dir)
    forced = tok.encode(" purple elephants juggle seven quiet violins", add_special_tokens=False)
    reqs = [dict(prompt="Write one sentence about the sea.", max_tokens=len(forced), logprobs=2,
                 extra_args={"force": {"tokens": forced, "tag": "t"}}),
            dict(prompt="Write one sentence about the sea.", max_tokens=len(forced))]
    res = run_engine_job(EngineJob(model=model_dir, requests=reqs, attention_backend="sfi", sfi={},
                                   engine_kwargs=dict(ENGINE, logits_processors=[forcing.FORCE_PROCESSOR]),
                                   collect=["sfi_vllm.tools.quality.forcing:collect"]), timeout=600)
    out, free = res["outputs"]
    assert out["token_ids"] == forced and free["token_ids"] != forced
    steps = res["collected"]["sfi_vllm.tools.quality.forcing:collect"]["tags"]["t"]
    assert [s["forced"] for s in steps] == forced
    assert raw_check(steps, out["logprobs"]) == 0
    for s, lp in zip(steps, out["logprobs"]):
        assert lp[str(s["forced"])] == pytest.approx(s["forced_logp"], abs=1e-5)
    assert steps[0]["top1"] == free["token_ids"][0]  # step 0: the unforced greedy token
    assert out["prompt_tokens"] == free["prompt_tokens"]


@pytest.mark.engine
def test_engine_dense_vs_dense_agrees_with_itself(model_dir, tmp_path):
    import json

    from sfi_vllm.tools.quality.fidelity import run_fidelity

    T = 8
    rows = run_fidelity(policies=("dense", "streaming"), retentions=(0.2,), contexts=(384,), docs=2, tokens=T,
                        seed=1, out=str(tmp_path / "f.jsonl"), raw_out=str(tmp_path / "raw.jsonl"),
                        model=model_dir, max_num_seqs=4, progress=False, kv_cache_gib=2)
    by = {r["policy"]: r for r in rows}
    d = by["dense"]
    assert d["n_docs"] == 2 and d["n_steps"] == 2 * T
    assert d["top1_agreement"] == 1.0 and d["kl_mean"] < 1e-4 and d["ref_self_top1"] == 1.0
    assert d["raw_check_mismatches"] == 0 and d["free_identical"] == 1.0
    s = by["streaming"]
    assert s["n_steps"] == 2 * T and 0 <= s["top1_agreement"] <= 1 and s["kl_mean"] >= 0
    assert s["measured_retention"] < 0.5 and s["raw_check_mismatches"] == 0
    raw = [json.loads(line) for line in (tmp_path / "raw.jsonl").read_text().splitlines()]
    free = {r["doc"]: r for r in raw if r["kind"] == "free-dense"}
    for r in raw:
        assert r["prompt_tokens"] == free[r["doc"]]["prompt_tokens"]  # forced tokens never joined the prompt
        if r["kind"] in ("ref", "forced"):
            assert r["decode_steps"] == T  # ... they went through T decode steps
        if r["kind"] == "forced":
            assert r["prefill_step_kl"] < 1e-4  # step 0 comes from the dense prefill, for every policy
    assert (tmp_path / "f.jsonl").read_text().count("\n") == 2


def test_engine_max_len_stays_within_the_model(tmp_path):
    from sfi_vllm.tools.quality.fidelity import engine_max_len

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    assert engine_max_len(str(tmp_path), [2048, 4096]) == 4608
    assert engine_max_len(str(tmp_path), [2048, 8192]) == 8192  # the H200 run failed here at 8704
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine_max_len(str(tmp_path), [16384])
    assert engine_max_len(str(tmp_path / "no-such-dir"), [2048]) == 2560


def test_top1_half_width_is_over_documents():
    from sfi_vllm.tools.quality.fidelity import doc_half_width, markdown

    assert doc_half_width([0.9]) is None
    # two documents at 0.5 and 1.0: sd 0.3536, t(1) 12.706 -> 12.706 * 0.3536 / sqrt(2) = 3.18
    assert doc_half_width([0.5, 1.0]) == pytest.approx(12.706 * 0.35355339 / 2 ** 0.5, rel=1e-4)
    refs = [dict(kind="ref", context=64, doc=d, self_top1=[1, 1, 1]) for d in range(3)]
    forced = [dict(kind="forced", policy="sfi", context=64, doc=d, retention=0.1, prompt_tokens=10,
                   top1=t, kl=[0.0, 0.1], nll_delta=[0.0, 0.0], fast_steps=2, slow_steps=0, decode_steps=2,
                   attended_fraction=0.5, raw_check_mismatches=0)
              for d, t in enumerate(([1, 1], [1, 0], [0, 0]))]
    (row,) = summarize(refs + forced, tokens=2)
    # per-document means 1, 0.5, 0: the same mean as pooling the steps, but the sample is 3 documents
    assert row["top1_agreement"] == 0.5
    assert row["top1_doc_half_width"] == pytest.approx(4.303 * 0.5 / 3 ** 0.5, abs=1e-4)
    assert "50.0% ± 124.2" in markdown([row])


def test_t975_matches_students_t_beyond_the_table():
    from sfi_vllm.tools.quality.fidelity import t975

    # exact quantiles (R: qt(0.975, df)); df 31 used to fall back to 1.96, 4% short
    for df, exact in ((1, 12.7062), (30, 2.0423), (31, 2.0395), (40, 2.0211), (60, 2.0003), (120, 1.9799),
                      (1000, 1.9623)):
        assert t975(df) == pytest.approx(exact, abs=5e-4)  # the table has three decimals
    with pytest.raises(ValueError):
        t975(0)


def test_paired_top1_is_per_document_and_skips_unshared_documents():
    from sfi_vllm.tools.quality.fidelity import markdown, paired_top1

    def forced(pol, r, doc, top1, ctx=64):
        return dict(kind="forced", policy=pol, retention=r, context=ctx, doc=doc, top1=top1)

    recs = [forced("sfi", 0.1, 0, [1, 1]), forced("sfi", 0.1, 1, [1, 0]), forced("sfi", 0.1, 2, [0, 0]),
            forced("streaming", 0.1, 0, [1, 0]), forced("streaming", 0.1, 1, [1, 0]),  # no doc 2
            forced("streaming", 0.2, 0, [0, 0]),                                       # other retention
            forced("dense", None, 0, [1, 1]), forced("dense", None, 1, [1, 1]), forced("dense", None, 2, [1, 1]),
            forced("sfi", 0.1, 0, [0, 0], ctx=128)]                                    # other context
    rows = {(r["context"], r["policy"]): r for r in paired_top1(recs)}
    assert set(rows) == {(64, "streaming"), (64, "dense")}  # nothing to pair at 128 or at 0.2
    s = rows[(64, "streaming")]
    assert (s["n_docs"], s["top1_diff"], s["retention"]) == (2, 0.25, 0.1)  # docs 0, 1: +0.5 and 0
    assert s["top1_diff_half_width"] == pytest.approx(12.706 * 0.35355339 / 2 ** 0.5, abs=1e-4)
    d = rows[(64, "dense")]
    assert (d["n_docs"], d["top1_diff"]) == (3, -0.5)
    md = markdown([], paired=paired_top1(recs))
    assert "| 64 | 0.10 | streaming | +25.0 ± 317.6 | 2 |" in md
