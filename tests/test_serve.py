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


def _start_servers(n: int, deterministic: bool = True):
    """n servers (ctx_len 16 = the default task's) on loopback, healthy."""
    procs, urls = [], []
    for _ in range(n):
        port = _free_port()
        flag = ["--deterministic"] if deterministic else []
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "detrl.serve", *flag, "--ctx-len", "16", "--port", str(port)],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
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
        [
            sys.executable,
            "train.py",
            *tiny,
            "steps=200",
            "checkpoint.every=1",
            "rollout=sglang",
            "rollout.sglang.urls=[" + ",".join(urls) + "]",
            "rollout.sglang.retries=1",
            "rollout.max_batch_size=8",
            f"run_dir={run_dir}",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
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
    body = {
        "input_ids": [[1, 5, 11], [1, 6]],
        "return_logprob": True,
        "rid": ["a", "b"],
        "sampling_params": [
            {"max_new_tokens": 3, "sampling_seed": 7, "stop_token_ids": [2]},
            {"max_new_tokens": 2, "sampling_seed": 8, "stop_token_ids": [2]},
        ],
    }
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


def test_training_against_servers_syncs_the_policy_exactly(tmp_path, servers):
    """The servers' rollout logprobs equal the trainer's recomputation at every step: each weight sync (tied
    names, dtype, no separate /flush_cache) reached them bit for bit."""
    urls = "[" + ",".join(servers) + "]"
    remote = run_tiny(
        tmp_path / "remote", "rollout=sglang", f"rollout.sglang.urls={urls}", "rollout.max_batch_size=8"
    )
    assert len(remote) == 3 and all(r["mismatch/train_rollout_logprob_abs_diff_max"] == 0.0 for r in remote)
    assert int(httpx.get(f"{servers[0]}/model_info").json()["weight_version"]) >= 2  # initial sync + updates
    _restore_fresh_weights(servers)


def _fresh_model():
    from detrl.config import ModelConfig
    from detrl.models.build import build_model

    return build_model(ModelConfig(name="qwen3"), seed=0)  # what `python -m detrl.serve` serves at start


def _restore_fresh_weights(urls):
    eng = SGLangEngine(urls, SamplingParams(), True, dtype=torch.float32)
    try:
        eng.update_weights(_fresh_model().state_dict())
    finally:
        eng.close()


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
    from detrl.rollout.sglang.launch import sglang_version

    monkeypatch.setitem(sys.modules, "sglang", None)  # as on a machine without it
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[sglang\]'.*rollout\.sglang\.urls"):
        sglang_version()


# ---------------------------------------------------------------- detrl.serve answers as SGLang 0.5.23 does


def _post(url, path, body, timeout=60):
    return httpx.post(f"{url}{path}", json=body, timeout=timeout)


def test_http_equals_a_direct_engine_call_bitwise_with_each_items_own_max_new_tokens(servers):
    """Tokens and logprobs through HTTP are those of the engine called directly (a separate engine built from
    the same seed); each item keeps its own max_new_tokens; finish_reason is SGLang's dict."""
    from detrl.models.ops import BATCH_INVARIANT_OPS
    from detrl.rollout.embedded import EmbeddedEngine

    prompts = [(1, 5, 11), (1, 6), (1, 7, 8, 9), (1, 5, 11)]
    caps, seeds = [1, 6, 3, 6], [7, 8, 9, 10]
    body = {
        "input_ids": [list(p) for p in prompts],
        "return_logprob": True,
        "rid": [f"eq{i}" for i in range(4)],
        "sampling_params": [
            {"max_new_tokens": c, "sampling_seed": s, "stop_token_ids": [2]} for c, s in zip(caps, seeds)
        ],
    }
    out = _post(servers[0], "/generate", body).json()
    direct = EmbeddedEngine(
        _fresh_model(), BATCH_INVARIANT_OPS, 16, SamplingParams(1.0, 1.0, max(caps), (2,)), seed=0
    )
    try:
        ref = direct.generate(
            [Request(i, 0, p, s, (), c) for i, (p, s, c) in enumerate(zip(prompts, seeds, caps))]
        )
    finally:
        direct.close()
    for o, r, cap in zip(out, ref, caps):
        m = o["meta_info"]
        assert o["output_ids"] == r.tokens and [lp for lp, _, _ in m["output_token_logprobs"]] == r.logprobs
        if r.finish_reason == "stop":
            assert m["finish_reason"] == {"type": "stop", "matched": r.tokens[-1]}
        else:
            assert len(r.tokens) == cap and m["finish_reason"] == {"type": "length", "length": cap}
    assert (
        len(out[0]["output_ids"]) == 1 and max(len(o["output_ids"]) for o in out) > 1
    )  # not the first's cap


def test_temperature_zero_is_greedy_over_http(servers):
    """SGLang's SamplingParams turns temperature 0 into top_k 1: every seed gives the argmax continuation, here
    checked against the model's own forward (transformers, no cache), token by token."""
    body = {
        "input_ids": [[1, 5, 11]] * 3,
        "sampling_params": [
            {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True, "sampling_seed": s} for s in (1, 2, 3)
        ],
    }
    resp = _post(servers[0], "/generate", body)
    assert resp.status_code == 200, resp.text
    outs = [o["output_ids"] for o in resp.json()]
    model, ids = _fresh_model().eval(), [1, 5, 11]
    with torch.no_grad():
        for _ in range(5):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert outs == [ids[3:]] * 3


def test_a_deterministic_server_gives_unseeded_requests_seed_42(servers):
    """sampling_batch_info.py from_schedule_batch: every unseeded request of a deterministic server samples
    with seed 42, so n unseeded samples of one prompt are identical."""

    def gen(sps):
        body = {"input_ids": [[1, 5, 11]] * len(sps), "return_logprob": True, "sampling_params": sps}
        return [o["output_ids"] for o in _post(servers[0], "/generate", body).json()]

    unseeded = gen([{"max_new_tokens": 6, "ignore_eos": True}] * 4)
    assert unseeded == gen([{"max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 42}] * 4)
    assert len({tuple(t) for t in unseeded}) == 1
    seeded = gen([{"max_new_tokens": 6, "ignore_eos": True, "sampling_seed": s} for s in range(4)])
    assert len({tuple(t) for t in seeded}) > 1  # per-sample seeds honoured


@pytest.fixture(scope="module")
def nondet_server():
    procs, urls = _start_servers(1, deterministic=False)
    yield urls[0]
    procs[0].terminate()
    procs[0].wait(timeout=30)


def test_a_nondeterministic_server_ignores_sampling_seed_and_says_so(nondet_server):
    body = {
        "input_ids": [[1, 5, 11]] * 8,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 3},
    }
    out = _post(nondet_server, "/generate", body).json()
    assert len({tuple(o["output_ids"]) for o in out}) > 1  # one seed, yet different samples: it is ignored
    for path in ("/server_info", "/get_server_info"):
        assert httpx.get(f"{nondet_server}{path}").json()["enable_deterministic_inference"] is False


def test_a_determinism_mismatch_is_refused_in_one_line(servers, nondet_server):
    with pytest.raises(ServerError) as e:  # determinism=on: seeds would be ignored
        SGLangEngine([nondet_server], SamplingParams(), True)
    assert nondet_server in str(e.value) and "--enable-deterministic-inference" in str(e.value)
    with pytest.raises(ServerError) as e:  # determinism=off: every unseeded request would get seed 42
        SGLangEngine(servers[:1], SamplingParams(), False)
    assert "42" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ServerError, match="--dtype bfloat16"):  # a policy in another dtype
        SGLangEngine(servers[:1], SamplingParams(), True, dtype=torch.bfloat16)
    SGLangEngine([nondet_server], SamplingParams(), False, dtype=torch.float32).close()  # matched: accepted


def test_weight_sync_needs_no_flush_reports_failures_in_one_line_and_cleans_up(servers):
    """/flush_cache answers plain text (SGLang) and is not called: /update_weights_from_disk flushes. A failed
    load is HTTP 400 with JSON, reported in one line and not retried. The weights dir goes with close()."""
    flushed = httpx.post(f"{servers[0]}/flush_cache")
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
    eng = SGLangEngine(servers[:1], SamplingParams(), True, dtype=torch.float32)
    try:
        eng.update_weights(_fresh_model().state_dict())
        weights = eng._weights_dir
        assert [p.name for p in weights.iterdir()] == ["model.safetensors"]
        bad = {"model.embed_tokens.weight": torch.zeros(3, 3)}
        t0 = time.time()
        with pytest.raises(ServerError) as e:
            eng.update_weights(bad)
        assert time.time() - t0 < 5 and "\n" not in str(e.value)  # not retried with backoff
        assert (
            "Failed to update weights" in str(e.value)
            and "HTTP 400" in str(e.value)
            and '"success"' not in str(e.value)
        )
        raw = _post(servers[0], "/update_weights_from_disk", {"model_path": str(weights)})
        assert raw.status_code == 400 and raw.json()["success"] is False
        assert (
            _post(servers[0], "/update_weights_from_disk", {"model_path": "/nonexistent"}).status_code == 400
        )
    finally:
        eng.close()
        _restore_fresh_weights(servers[:1])
    assert not weights.exists()


def test_tied_embeddings_are_written_under_the_name_sglang_loads():
    """Qwen3-0.6B..4B tie lm_head to the embeddings: safetensors' save_file refuses the shared tensor, and
    save_model would keep 'lm_head.weight', a name SGLang's tied Qwen3 has no parameter for."""
    import tempfile
    from pathlib import Path

    from safetensors.torch import load_file

    from detrl.config import ModelConfig
    from detrl.models.build import build_model
    from detrl.rollout.sglang import save_weights
    from detrl.rollout.sglang.weights import load_weights_from_disk

    src = build_model(ModelConfig(name="qwen3", tie_word_embeddings=True), seed=1)
    dst = build_model(ModelConfig(name="qwen3", tie_word_embeddings=True), seed=2)
    assert src.lm_head.weight.data_ptr() == src.model.embed_tokens.weight.data_ptr()
    with tempfile.TemporaryDirectory() as d:
        f = save_weights(src.state_dict(), Path(d))
        names = set(load_file(str(f)))
        assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
        load_weights_from_disk(dst, d)
    for (k, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), k
    assert dst.lm_head.weight.data_ptr() == dst.model.embed_tokens.weight.data_ptr()


def test_a_retry_after_a_timeout_uses_fresh_rids(servers):
    """SGLang holds a timed-out request's rid (a retry with it gets 'Duplicate request ID detected'); a paused
    server (default mode "abort") queues /generate until /continue_generation."""
    url = servers[0]
    body = {
        "input_ids": [[1, 5]],
        "rid": ["dup"],
        "sampling_params": [{"max_new_tokens": 2, "sampling_seed": 1}],
    }
    paused = _post(url, "/pause_generation", {})
    assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
    try:
        import threading

        held = []
        waiter = threading.Thread(target=lambda: held.append(_post(url, "/generate", body)))
        waiter.start()
        time.sleep(1.0)
        assert waiter.is_alive()  # queued, not refused
        dup = _post(url, "/generate", body)
        assert dup.status_code == 400 and dup.json() == {
            "error": {"message": "Duplicate request ID detected: dup"}
        }
        eng = SGLangEngine(
            [url],
            SamplingParams(max_new_tokens=2, stop_token_ids=(2,)),
            True,
            timeout_s=1.5,
            retries=2,
            backoff_s=0.01,
            health_timeout_s=5,
        )
        timer = threading.Timer(2.0, lambda: _post(url, "/continue_generation", {}))
        timer.start()
        got = eng.generate([Request(3, 0, (1, 5), 11), Request(3, 1, (1, 6), 12)])  # 1st attempt times out
        timer.join()
        waiter.join(timeout=30)
        assert held[0].status_code == 200 and held[0].json()[0]["meta_info"]["id"] == "dup"
        again = eng.generate([Request(3, 0, (1, 5), 11), Request(3, 1, (1, 6), 12)])
        assert [(r.tokens, r.logprobs) for r in got] == [(r.tokens, r.logprobs) for r in again]
        eng.close()
    finally:
        _post(url, "/continue_generation", {})


class _SlowEngine:
    """Stands in for the embedded engine inside `Server`: token 5 + position every 20 ms until cut or done."""

    def __init__(self):
        import threading
        from types import SimpleNamespace

        self.cut = threading.Event()
        self.model = SimpleNamespace(config=SimpleNamespace(eos_token_id=2, vocab_size=64))
        self.calls: list[list[Request]] = []

    def abort(self):
        self.cut.set()

    def generate(self, reqs, params):
        from detrl.rollout.base import Result

        self.cut.clear()
        self.calls.append(reqs)
        toks = [[] for _ in reqs]
        for _ in range(max(r.max_new_tokens for r in reqs)):
            if self.cut.is_set():
                break
            time.sleep(0.02)
            for r, t in zip(reqs, toks):
                if len(t) < r.max_new_tokens:
                    t.append(5 + len(r.prompt_ids) + len(r.prefix) + len(t))
        return [
            Result(r, t, [-1.0] * len(t), "length" if len(t) == r.max_new_tokens else "abort")
            for r, t in zip(reqs, toks)
        ]


def _server_thread(server, body):
    import threading

    out = {}
    th = threading.Thread(target=lambda: out.update(r=server.generate(body)))
    th.start()
    return th, out


def _wait(cond, timeout=10.0):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline
        time.sleep(0.005)


def test_abort_request_aborts_its_rid_only_and_pause_modes_behave_as_sglangs():
    from detrl.rollout.sglang.server import Server

    eng = _SlowEngine()
    server = Server(eng, eng.model, "<fake>", True, 0, 64)
    body = {"input_ids": [[1], [1]], "rid": ["a1", "b1"], "sampling_params": {"max_new_tokens": 20}}
    th, out = _server_thread(server, body)
    _wait(lambda: server.running_call)
    time.sleep(0.1)
    server.abort("nope", False)  # a rid no live request holds: nothing
    server.abort("a1", False)
    th.join(timeout=10)
    a, b = out["r"]
    assert a["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    assert 0 < len(a["output_ids"]) < 20
    assert b["meta_info"]["finish_reason"] == {"type": "length", "length": 20} and len(b["output_ids"]) == 20
    assert b["output_ids"] == [
        6 + i for i in range(20)
    ]  # continued from its prefix, nothing lost or repeated
    assert len(eng.calls) == 2 and eng.calls[1][0].prefix  # the 2nd call continues b1 alone

    # retract: running requests come back to the queue and resume at continue; new ones wait
    th, out = _server_thread(server, {**body, "rid": ["a2", "b2"]})
    _wait(lambda: server.running_call)
    server.pause("retract")
    th2, out2 = _server_thread(
        server, {"input_ids": [1, 2], "rid": "c2", "sampling_params": {"max_new_tokens": 3}}
    )
    time.sleep(0.2)
    assert th.is_alive() and th2.is_alive()
    assert server.flush_cache()  # retracted requests do not block a flush while paused
    server.resume()
    th.join(timeout=10)
    th2.join(timeout=10)
    assert [len(o["output_ids"]) for o in out["r"]] == [20, 20] and out["r"][0]["meta_info"][
        "num_retractions"
    ] == 1
    assert out2["r"]["output_ids"] == [7, 8, 9] and out2["r"]["meta_info"]["id"] == "c2"

    # in_place: a weight update's flush fails while requests are held in the running batch
    th, out = _server_thread(server, {**body, "rid": ["a3", "b3"]})
    _wait(lambda: server.running_call)
    server.pause("in_place")
    assert not server.flush_cache()
    server.resume()
    th.join(timeout=10)

    # abort (the default): everything in flight ends now, with finish_reason abort
    th, out = _server_thread(server, {**body, "rid": ["a4", "b4"]})
    _wait(lambda: server.running_call)
    server.pause("abort")
    th.join(timeout=10)
    assert [o["meta_info"]["finish_reason"]["type"] for o in out["r"]] == ["abort", "abort"]
    server.resume()


def test_the_client_reads_sglangs_finish_reasons_and_retries_a_server_abort():
    eng = SGLangEngine.__new__(SGLangEngine)
    eng.params = SamplingParams(max_new_tokens=4, stop_token_ids=(2,))
    batch = [Request(1, 0, (1,), 5), Request(1, 1, (1,), 6), Request(1, 2, (1,), 7, (9,), 2)]

    def item(toks, fr):
        return {
            "output_ids": toks,
            "meta_info": {
                "id": "x",
                "finish_reason": fr,
                "output_token_logprobs": [[-0.5, t, None] for t in toks],
            },
        }

    res, aborted = eng._parse(
        batch,
        [
            item([3, 2], {"type": "stop", "matched": 2}),
            item([3, 3, 3, 3], {"type": "length", "length": 4}),
            item([3, 3], {"type": "length", "length": 2}),
        ],
    )
    assert aborted is None and [r.finish_reason for r in res] == ["stop", "length", "abort"]
    _, aborted = eng._parse(batch[:1], [item([3], {"type": "abort", "message": "Abort in waiting queue"})])
    assert aborted == "Abort in waiting queue"
