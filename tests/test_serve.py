"""rollout=sglang against `python -m detrl.serve`, a real HTTP server speaking SGLang's protocol."""

import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from detrl.rollout.base import Request, SamplingParams
from detrl.rollout.sglang import ServerError, SGLangEngine
from tests.conftest import ROOT, run_tiny

FP = ["fp/rollout_tokens", "fp/rollout_logprobs", "fp/batch_order", "fp/params"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_servers(n: int):
    """n deterministic servers (ctx_len 16 = the default task's) on loopback, healthy."""
    procs, urls = [], []
    for _ in range(n):
        port = _free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "detrl.serve", "--deterministic", "--ctx-len", "16",
                                       "--port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        urls.append(f"http://127.0.0.1:{port}")
    deadline = time.time() + 120
    for url in urls:
        while time.time() < deadline:
            try:
                if httpx.get(f"{url}/health_generate", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
    return procs, urls


@pytest.fixture(scope="module")
def servers():
    procs, urls = _start_servers(2)
    yield urls
    for p in procs:
        p.terminate()
        p.wait(timeout=30)


def test_killing_a_server_mid_run_names_it_and_keeps_logs_and_checkpoints(tmp_path):
    from detrl import checkpoint
    from detrl.analysis import load_metrics
    from tests.conftest import TINY

    procs, urls = _start_servers(2)
    run_dir = tmp_path / "run"
    tiny = [o for o in TINY if not o.startswith("steps=")]
    train = subprocess.Popen(
        [sys.executable, "train.py", *tiny, "steps=200", "checkpoint.every=1", "rollout=sglang",
         "rollout.sglang.urls=[" + ",".join(urls) + "]", "rollout.sglang.retries=1", "rollout.max_batch_size=8",
         f"run_dir={run_dir}"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, metrics = time.time() + 120, run_dir / "metrics.jsonl"
        while time.time() < deadline and (not metrics.is_file() or len(metrics.read_text().splitlines()) < 2):
            time.sleep(0.05)
        procs[1].kill()
        _, err = train.communicate(timeout=120)
    finally:
        for p in procs:
            p.kill()
    assert train.returncode == 1
    lines = [line for line in err.splitlines() if line.startswith("detrl:")]
    assert len(lines) == 1 and urls[1] in lines[0] and "Traceback" not in err
    rows = load_metrics(run_dir)
    assert len(rows) >= 2 and [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    last = checkpoint.latest(run_dir)
    assert last is not None and int(last.name.split("-")[1]) == len(rows)
    assert torch.load(last / "state.pt", weights_only=False)["run"]["step"] == len(rows)


def test_protocol_shapes(servers):
    body = {"input_ids": [[1, 5, 11], [1, 6]], "return_logprob": True, "rid": ["a", "b"],
            "sampling_params": [{"max_new_tokens": 3, "sampling_seed": 7, "stop_token_ids": [2]},
                                {"max_new_tokens": 2, "sampling_seed": 8, "stop_token_ids": [2]}]}
    out = httpx.post(f"{servers[0]}/generate", json=body, timeout=30).json()
    assert [o["meta_info"]["id"] for o in out] == ["a", "b"]
    for o, cap in zip(out, (3, 2)):
        m = o["meta_info"]
        assert m["finish_reason"]["type"] in ("stop", "length") and 1 <= m["completion_tokens"] <= cap
        assert [t for _, t, _ in m["output_token_logprobs"]] == o["output_ids"]
        assert all(lp <= 0 for lp, _, _ in m["output_token_logprobs"])
    again = httpx.post(f"{servers[0]}/generate", json=body, timeout=30).json()
    assert again == out  # same seeds, deterministic server: same bits
    assert httpx.get(f"{servers[0]}/get_model_info").json()["is_generation"] is True
    assert httpx.post(f"{servers[0]}/flush_cache").status_code == 200


@pytest.mark.parametrize("extra", [[], ["rollout.partial.enabled=true"]], ids=["plain", "partial"])
def test_training_against_servers_equals_the_embedded_engine_bitwise(tmp_path, servers, extra):
    urls = "[" + ",".join(servers) + "]"
    remote = run_tiny(tmp_path / "remote", "rollout=sglang", f"rollout.sglang.urls={urls}",
                      "rollout.max_batch_size=8", *extra)
    local = run_tiny(tmp_path / "local", "rollout.max_batch_size=8", *extra)
    assert [[r[k] for k in FP] for r in remote] == [[r[k] for k in FP] for r in local]
    assert all(r["mismatch/train_rollout_logprob_abs_diff_max"] == 0.0 for r in remote)


def test_a_dead_server_is_named_in_one_error():
    port = _free_port()  # nothing listens there
    with pytest.raises(ServerError, match=f"127.0.0.1:{port}"):
        SGLangEngine([f"http://127.0.0.1:{port}"], SamplingParams(), True, health_timeout_s=1)


def test_retries_then_names_the_server(servers):
    eng = SGLangEngine(servers[:1], SamplingParams(max_new_tokens=2), True, retries=1, backoff_s=0.01)
    eng.urls = ["http://127.0.0.1:1"]  # the server went away mid-run
    with pytest.raises(ServerError, match="127.0.0.1:1 failed 2 times"):
        eng.generate([Request(0, 0, (1, 5), 3)])


def test_launching_without_sglang_says_how_to_install(monkeypatch):
    from detrl.config import ConfigError
    from detrl.rollout.sglang_launch import sglang_version

    monkeypatch.setitem(sys.modules, "sglang", None)  # as on a machine without it
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[sglang\]'.*rollout\.sglang\.urls"):
        sglang_version()
