"""Serving through the OpenAI server on CPU, with the ``openai`` client: a request's SFI settings
over HTTP (``vllm_xargs``), their validation (a 400 naming the field, while other requests keep
running), SFI's metrics on ``/metrics``, and a concurrent load with cancellations.

One server for the module (about 40 s to start), started as the README's "Serving on CPU" says,
with ``PROMETHEUS_MULTIPROC_DIR`` set so the worker's metrics reach ``/metrics``. The tests run in
file order and measure metric deltas, so each must leave no request running.
"""

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

import pytest

pytestmark = pytest.mark.engine

# K = 32: the compact buffers hold sinks + K = 36 tokens. The boundary trigger is off; the engine
# still takes the enders from the tokenizer, so a request can turn it on.
SFI = {"sinks": 4, "recent_window": 32, "selected_tokens": 32, "reuse_budget": 8, "min_gap": 2,
       "boundary_trigger": False, "bridge_steps": 0}
MAX_NUM_SEQS = 16
STORY = ("The old lighthouse keeper climbed the stairs every evening. He lit the lamp and watched "
         "the ships pass. ") * 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir():
    from sfi_vllm.tools.model_prep import prepare_model

    return str(prepare_model(progress=False))


class Server:
    def __init__(self, proc, port, log_path, model):
        self.proc, self.port, self.log_path, self.model = proc, port, log_path, model
        self.url = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict:
        """{(name, labels as a sorted tuple): value} of every sample on /metrics."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def client(self):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)


def total(metrics: dict, name: str, **labels) -> float:
    return sum(v for (n, lab), v in metrics.items()
               if n == name and all(dict(lab).get(k) == str(x) for k, x in labels.items()))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    import httpx

    tmp = tmp_path_factory.mktemp("serving")
    prom = tmp / "prometheus"
    prom.mkdir()
    port = _free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--host", "127.0.0.1", "--port", str(port), "--attention-backend", "sfi",
           "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", str(MAX_NUM_SEQS),
           "--enforce-eager", "--generation-config", "vllm",
           "--additional-config", json.dumps({"sfi": SFI})]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PROMETHEUS_MULTIPROC_DIR": str(prom)}
    log_path = tmp / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    srv = Server(proc, port, log_path, model_dir)
    try:
        deadline = time.time() + 300
        while True:
            assert proc.poll() is None, srv.log()[-4000:]
            try:
                if httpx.get(f"{srv.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "server did not come up in 300 s"
            time.sleep(2)
        yield srv
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _chat(client, model, xargs=None, max_tokens=8, stream=False, **kw):
    body = {"vllm_xargs": xargs} if xargs is not None else None
    return client.chat.completions.create(
        model=model, temperature=0, max_tokens=max_tokens, stream=stream, extra_body=body,
        messages=[{"role": "user", "content": STORY + "What did the keeper do?"}], **kw)


def _completion(client, model, xargs=None, max_tokens=8, stream=False, **kw):
    body = {"vllm_xargs": xargs} if xargs is not None else None
    return client.completions.create(model=model, prompt=STORY + "Every evening the keeper", temperature=0,
                                     max_tokens=max_tokens, stream=stream, extra_body=body, **kw)


# (vllm_xargs, the field the 400 must name, a word of the allowed values or the reason)
BAD_REQUESTS = [
    ({"sfi": "dense"}, "vllm_xargs.sfi", "JSON object"),
    ({"sfi": [1, 2]}, "vllm_xargs.sfi", "object of SFI settings"),
    ({"sfi": 3}, "vllm_xargs.sfi", "object of SFI settings"),
    ({"sfi": {"policy": "dense"}}, "vllm_xargs", ""),  # a nested object: vLLM's own 400
    ({"sfi": '{"policy": "fastest"}'}, "vllm_xargs.sfi.policy", "'streaming'"),
    ({"sfi": '{"recent_windw": 8}'}, "vllm_xargs.sfi.recent_windw", "recent_window"),
    ({"sfi": '{"selector": "strong"}'}, "vllm_xargs.sfi.selector", "must be an object of selector settings"),
    ({"sfi_polcy": "dense"}, "vllm_xargs.sfi_polcy", "sfi_policy"),
    ({"sfi_selector": "strong"}, "vllm_xargs.sfi_selector", "sfi_selector_alpha"),
    ({"sfi_policy": "fastest"}, "vllm_xargs.sfi_policy", "'quest'"),
    ({"sfi_policy": 3}, "vllm_xargs.sfi_policy", "'dense'"),
    ({"sfi_selected_tokens": -1}, "vllm_xargs.sfi_selected_tokens", "0 <= value <= 1048576"),
    ({"sfi_selected_tokens": "many"}, "vllm_xargs.sfi_selected_tokens", "valid integer"),
    ({"sfi_selected_tokens": [16]}, "vllm_xargs.sfi_selected_tokens", "valid integer"),
    ({"sfi_selected_tokens": 64}, "vllm_xargs.sfi_selected_tokens", "sinks + K <= 36"),
    ({"sfi_selected_fraction": 1.5}, "vllm_xargs.sfi_selected_fraction", "0.0 < value <= 1.0"),
    ({"sfi_selected_fraction": 0.5}, "vllm_xargs.sfi_selected_fraction", "sinks + K <= 36"),
    ({"sfi_boundary_trigger": "maybe"}, "vllm_xargs.sfi_boundary_trigger", "true or false"),
    ({"sfi_kernels": "torch"}, "vllm_xargs.sfi_kernels", "engine-wide setting"),
    ({"sfi_stats_file": "/tmp/x.jsonl"}, "vllm_xargs.sfi_stats_file", "engine-wide setting"),
    ({"sfi_selector_alpha": 100}, "vllm_xargs.sfi_selector_alpha", "0.0 < value <= 4.0"),
    ({"sfi_min_gap": 100}, "vllm_xargs.sfi_min_gap", "must be <= reuse_budget"),
    ({"sfi_preset": "fast"}, "vllm_xargs.sfi_preset", "balanced, speed, paper"),
    ({"sfi": '{"sinks": 2}', "sfi_sinks": 2}, "vllm_xargs.sfi_sinks", "given twice"),
    ({"sfi.selected_tokens": 16}, "vllm_xargs.sfi.selected_tokens", "did you mean 'sfi_selected_tokens'"),
]


def _stream_chat_in_thread(server, max_tokens=24):
    """Start a streaming chat request; returns (thread, result dict)."""
    result = {}
    started = threading.Event()

    def run():
        try:
            n, finish = 0, None
            for chunk in _chat(server.client(), server.model, max_tokens=max_tokens, stream=True):
                started.set()
                if chunk.choices:
                    n += bool(chunk.choices[0].delta.content)
                    finish = chunk.choices[0].finish_reason or finish
            result.update(chunks=n, finish=finish)
        except Exception as e:  # noqa: BLE001 - reported by the test
            result["error"] = repr(e)
        finally:
            started.set()

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(120), "the stream produced nothing in 120 s"
    return t, result


def test_bad_sfi_settings_get_a_400_naming_the_field_while_others_run(server):
    import httpx
    import openai

    client = server.client()
    stream, result = _stream_chat_in_thread(server)
    answers = []
    for i, (xargs, field, hint) in enumerate(BAD_REQUESTS):
        call = _completion if i % 2 else _chat  # both endpoints
        with pytest.raises(openai.BadRequestError) as info:
            call(client, server.model, xargs)
        err = info.value
        body = err.body if isinstance(err.body, dict) else {}
        text = json.dumps(body)
        assert err.status_code == 400, (xargs, text)
        assert field in text and hint in text, (xargs, text)
        if field.startswith("vllm_xargs.sfi"):
            assert body.get("param") == field, (xargs, body)
        answers.append((xargs, err.status_code, body.get("param"), body.get("message", "")[:200]))
    # a bad streaming request: an HTTP 400 before any stream starts (not vLLM's error event inside
    # a 200 stream, which also logs a traceback), on both routes
    for route, body in (("completions", {"prompt": "Hello", "max_tokens": 4}),
                        ("chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}),
                        ("responses", {"input": "Hello", "max_output_tokens": 4})):
        r = httpx.post(f"{server.url}/v1/{route}", timeout=60, json={
            "model": server.model, "stream": True, "vllm_xargs": {"sfi": "dense"}, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "vllm_xargs.sfi", r.text
    assert "stream generator" not in server.log()
    r = httpx.post(f"{server.url}/v1/responses", timeout=120, json={  # the wrapped route still serves
        "model": server.model, "input": "Hello", "max_output_tokens": 4, "vllm_xargs": {"sfi_reuse_budget": 4}})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 4, r.text
    # beam search runs its steps without vllm_xargs: SFI settings with it are refused, not dropped
    for route, body in (("completions", {"prompt": "Every evening the keeper"}),
                        ("chat/completions", {"messages": [{"role": "user", "content": "Hello"}]})):
        beam = {"model": server.model, "max_tokens": 3, "use_beam_search": True, "n": 2, **body}
        r = httpx.post(f"{server.url}/v1/{route}", timeout=120,
                       json={**beam, "vllm_xargs": {"sfi_selected_tokens": 16}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "vllm_xargs.sfi_selected_tokens", r.text
        assert "beam search" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": server.model, "max_tokens": 3, "use_beam_search": True, "n": 2, "prompt": "Every evening the keeper"})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text  # beam search itself runs
    stream.join(120)
    assert result.get("finish") in ("length", "stop") and result["chunks"] > 1, result
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    print("\nbad-input table:\n" + "\n".join(json.dumps(a) for a in answers))


def _decode_step_deltas(before: dict, after: dict) -> dict:
    return {kind: total(after, f"sfi_{kind}_steps_total") - total(before, f"sfi_{kind}_steps_total")
            for kind in ("prefill", "dense", "fast", "slow")}


@pytest.mark.parametrize("form", ["flat", "json", "none"])
def test_request_settings_over_http_configure_the_request(server, form):
    """Every decode step of one request shows up in the metrics in the mode its settings ask
    for: flat keys (``sfi_policy: dense``: every step dense), one JSON string (a smaller K, a
    reuse budget of 4: fast and slow steps), none (the engine's settings)."""
    client = server.client()
    xargs = {"flat": {"sfi_policy": "dense"},
             "json": {"sfi": json.dumps({"selected_tokens": 16, "reuse_budget": 4, "min_gap": 1})},
             "none": None}[form]
    before = server.metrics()
    tokens = 0
    for call, stream in ((_chat, False), (_completion, True)):  # chat and completions, streamed or not
        out = call(client, server.model, xargs, max_tokens=12, stream=stream, **(
            {"stream_options": {"include_usage": True}} if stream else {}))
        if stream:
            usage = [c.usage for c in out if c.usage is not None][-1]
        else:
            usage = out.usage
        tokens += usage.completion_tokens
    d = _decode_step_deltas(before, server.metrics())
    assert d["dense"] + d["fast"] + d["slow"] == tokens - 2  # the first token of each comes from the prefill
    if form == "flat":
        assert d["fast"] == d["slow"] == 0
    else:
        assert d["dense"] == 0 and d["fast"] > 0 and d["slow"] >= 2
    if form == "json":  # reuse budget 4: at most 4 fast steps per slow step
        assert d["fast"] <= 4 * d["slow"]


def test_a_request_turns_on_the_boundary_trigger_the_engine_left_off(server):
    """The engine starts with the boundary trigger off; a request that turns it on gets slow steps
    at its sentence ends (the enders come from the tokenizer whatever the engine's own setting)."""
    before = server.metrics()
    out = _chat(server.client(), server.model, {"sfi_boundary_trigger": True, "sfi_reuse_budget": 64},
                max_tokens=32)
    text = out.choices[0].message.content
    assert any(c in text[:-1] for c in ".!?"), f"no sentence end before the last token: {text!r}"
    boundary = (total(server.metrics(), "sfi_slow_steps_total", reason="boundary")
                - total(before, "sfi_slow_steps_total", reason="boundary"))
    assert boundary > 0, text


def test_metrics_are_on_the_servers_metrics_endpoint(server):
    m = server.metrics()
    names = {n for n, _ in m}
    for name in ("sfi_requests_total", "sfi_fast_steps_total", "sfi_slow_steps_total", "sfi_dense_steps_total",
                 "sfi_prefill_steps_total", "sfi_fast_attended_tokens_total", "sfi_fast_context_tokens_total",
                 "sfi_fast_layer_evaluations_total", "sfi_request_attended_fraction_count",
                 "sfi_selection_seconds_count", "sfi_compact_sets", "sfi_compact_sets_in_use"):
        assert name in names, name
    assert 0 <= total(m, "sfi_compact_sets_in_use") <= total(m, "sfi_compact_sets") > 0
    # every known label value is listed from the start, 0 until it happens: a dashboard on the
    # fallbacks reads 0, not "no data"
    from sfi_vllm.stats import FALLBACK_REASONS, REASON_NAMES

    for reason in FALLBACK_REASONS:
        assert ("sfi_request_fallbacks_total", (("reason", reason),)) in m, reason
    for reason in REASON_NAMES.values():
        assert ("sfi_slow_steps_total", (("reason", reason),)) in m, reason
    assert total(m, "sfi_slow_steps_total", reason="first_decode") > 0
    assert total(m, "sfi_slow_steps_total", reason="reuse_budget") > 0
    assert 0 < total(m, "sfi_fast_attended_tokens_total") < total(m, "sfi_fast_context_tokens_total")
    assert total(m, "sfi_selection_seconds_count") > 0
    assert "vllm:num_requests_running" in {n for n, _ in m}  # vLLM's own metrics are still there
    import httpx

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    print("\nscrape:\n" + "\n".join(x for x in text.splitlines() if x.startswith("sfi_") and "_bucket" not in x))


def test_concurrent_streams_with_cancellations(server):
    """64 streaming requests at once (chat and completions), a quarter cancelled after their
    first few tokens: every other one completes, /health answers 200 throughout, the log has no
    traceback, and the metrics count every request served."""
    import httpx
    import openai

    n, rng = 64, random.Random(0)
    cancel_after = {i: rng.randint(1, 3) for i in rng.sample(range(n), n // 4)}
    client = server.client()
    # the worker retires a request when the next step's scheduler output names it finished: this
    # request retires whatever an earlier test left, and is itself the one request not yet retired
    _chat(client, server.model, max_tokens=2)
    before = server.metrics()
    log_before = len(server.log())
    health = []

    async def one(client, i):
        t0 = time.perf_counter()
        kw = dict(model=server.model, temperature=0, max_tokens=12, stream=True)
        prompt = f"{i}. " + STORY[:len(STORY) // 3]  # short prompts: the load is about isolation
        if i % 2:
            stream = await client.completions.create(prompt=prompt, **kw)
        else:
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": prompt + "Who climbed?"}], **kw)
        got, finish, ttft = 0, None, None
        async for chunk in stream:
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            text = c.text if i % 2 else c.delta.content
            if text:
                got += 1
                ttft = ttft if ttft is not None else time.perf_counter() - t0
            finish = c.finish_reason or finish
            if i in cancel_after and got >= cancel_after[i]:
                await stream.close()
                return i, "cancelled", ttft, time.perf_counter() - t0
        return i, finish, ttft, time.perf_counter() - t0

    async def watch_health(done):
        async with httpx.AsyncClient() as h:
            while not done.is_set():
                health.append((await h.get(f"{server.url}/health", timeout=10)).status_code)
                await asyncio.sleep(0.5)

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        done = asyncio.Event()
        watcher = asyncio.create_task(watch_health(done))
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(client, i) for i in range(n)))
        wall = time.perf_counter() - t0
        done.set()
        await watcher
        return results, wall

    results, wall = asyncio.run(main())
    finished = [r for r in results if r[1] != "cancelled"]
    assert len(finished) == n - len(cancel_after)
    assert all(r[1] in ("length", "stop") for r in finished), [r for r in finished if r[1] not in ("length", "stop")]
    assert health and all(s == 200 for s in health), health
    # two requests after the load: the first retires the 64, the second the first
    for _ in range(2):
        _chat(client, server.model, max_tokens=2)
    after = server.metrics()
    served = total(after, "sfi_requests_total") - total(before, "sfi_requests_total")
    assert served == 1 + n + 1, served  # the request before the load, the 64, the first after
    vllm_ok = total(after, "vllm:request_success_total") - total(before, "vllm:request_success_total")
    assert vllm_ok == len(finished) + 2
    assert total(after, "sfi_request_fallbacks_total") == total(before, "sfi_request_fallbacks_total")
    # every compact set is free again but the last request's, which the worker has not retired
    assert total(after, "sfi_compact_sets_in_use") <= 1, total(after, "sfi_compact_sets_in_use")
    assert server.proc.poll() is None
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    new_log = server.log()[log_before:]
    assert "Traceback" not in new_log and "EngineCore encountered" not in new_log, new_log[-4000:]
    ttfts = sorted(r[2] for r in results if r[2] is not None)
    ends = sorted(r[3] for r in finished)
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
    print(f"\nload: {n} streams, {len(cancel_after)} cancelled, {len(finished)} finished, wall {wall:.1f} s; "
          f"TTFT p50 {q(ttfts, 0.5):.2f} s p90 {q(ttfts, 0.9):.2f} s; end-to-end (finished) "
          f"p50 {q(ends, 0.5):.2f} s p90 {q(ends, 0.9):.2f} s max {ends[-1]:.2f} s; "
          f"/health polls {len(health)}, all 200; sfi_requests_total +{served:.0f}")
