"""detrl.serve's answers, through FastAPI's test client over a stand-in engine (no server process): each as
SGLang 0.5.23's code answers it (status code and JSON shape), and the client's refusal of answers that are not."""

import json
import tempfile
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from detrl.rollout.base import Request, Result, SamplingParams
from detrl.rollout.sglang import ServerError, SGLangEngine, save_weights
from detrl.rollout.sglang.app import make_app
from detrl.rollout.sglang.server import GREEDY_TOP_P, Limits, Server

VOCAB = 64


class _EchoEngine:
    """The engine interface the server uses: every token is the length of its request's prompt."""

    def __init__(self):
        self.calls: list[tuple[list[Request], SamplingParams]] = []
        self.updates = 0

    def generate(self, reqs, params):
        self.calls.append((reqs, params))
        return [
            Result(r, [len(r.prompt_ids)] * r.max_new_tokens, [-0.5] * r.max_new_tokens, "length")
            for r in reqs
        ]

    def abort(self):
        pass

    def update_weights(self, state_dict):
        self.updates += 1


@pytest.fixture(scope="module")
def model():
    from detrl.config import ModelConfig
    from detrl.models.build import build_model

    return build_model(ModelConfig(name="qwen3", vocab_size=VOCAB), seed=0)


def _client(model, **limits):
    engine = _EchoEngine()
    server = Server(engine, model, "/m", True, 0, 16, limits=Limits(**limits))
    return TestClient(make_app(server)), engine, server


def _gen(client, **body):
    return client.post("/generate", json=body)


def test_a_string_rid_names_each_item_of_a_batch_as_sglang_expands_it(model):
    """io_struct.py _normalize_rid: a batch with one string rid gets "<rid>_<i>" per item."""
    client, _, _ = _client(model)
    out = _gen(client, input_ids=[[1, 2], [3]], rid="job", sampling_params={"max_new_tokens": 1})
    assert out.status_code == 200 and [o["meta_info"]["id"] for o in out.json()] == ["job_0", "job_1"]
    dup = _gen(client, input_ids=[[1], [2]], rid=["x", "x"])
    assert dup.status_code == 400 and dup.json() == {
        "error": {"message": "Duplicate request IDs detected within the request: ['x']"}
    }


def test_n_samples_per_prompt_prompt_major(model):
    """io_struct.py _handle_parallel_sampling + tokenizer_manager.py _handle_batch_request: n per prompt, the
    prompt's samples together, each with a fresh rid; a single prompt with n > 1 answers a list."""
    client, _, _ = _client(model)
    out = _gen(
        client, input_ids=[[1, 2, 3], [4]], rid=["a", "b"], sampling_params={"n": 2, "max_new_tokens": 2}
    )
    items = out.json()
    assert out.status_code == 200 and len(items) == 4
    assert [o["output_ids"] for o in items] == [[3, 3], [3, 3], [1, 1], [1, 1]]
    assert len({o["meta_info"]["id"] for o in items}) == 4 and not {"a", "b"} & {
        o["meta_info"]["id"] for o in items
    }
    single = _gen(client, input_ids=[1, 2], sampling_params={"n": 3, "max_new_tokens": 1}).json()
    assert isinstance(single, list) and len(single) == 3
    mixed = _gen(client, input_ids=[[1], [2]], sampling_params=[{"n": 2}, {"n": 1}])
    assert (
        mixed.status_code == 400
        and "parallel_sample_num should be the same" in mixed.json()["error"]["message"]
    )


@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"input_ids": []}, 400, "input_ids cannot be empty."),
        ({"input_ids": [[1], []]}, 400, "input_ids cannot be empty."),
        ({"input_ids": [1, -5]}, 400, "input_ids contains out-of-vocabulary token id -5; valid range is [0, 64)."),
        ({"input_ids": [1, 64]}, 400, "input_ids contains out-of-vocabulary token id 64; valid range is [0, 64)."),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, 400, "temperature must be a non-negative finite number, got -1."),
        ({"input_ids": [1], "sampling_params": {"top_p": 5}}, 400, "top_p must be in (0, 1], got 5."),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, 400, "top_p must be in (0, 1], got 0."),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, 400, "max_new_tokens must be at least 0, got -1."),
        ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, 400, 'invalid type: string "hot", expected f64'),
        ({"input_ids": [1], "sampling_params": {"stop_token_ids": "x"}}, 400, 'invalid type: string "x", expected a sequence'),
        ({"input_ids": [1], "sampling_params": {"stop": "\n"}}, 400, "stop=['\\n'] is unavailable when skip_tokenizer_init=True"),
        ({"text": "hi"}, 400, "The engine initialized with skip_tokenizer_init=True cannot accept text prompts"),
        ({"input_ids": [1], "sampling_params": {"top_k": 5}}, 400, "detrl.serve does not implement top_k=5"),
        ({"input_ids": 5}, 422, "must be list or null; got int"),
        ({"input_ids": [["a"]]}, 422, "row 0: elements must be int; got str"),
        ({"input_ids": [[1]], "rid": 123}, 422, "Input should be a valid string"),
        ([1, 2], 422, ""),
    ],
)  # fmt: skip
def test_bad_requests_answer_sglangs_status_and_message_never_500(model, body, status, message):
    """FastAPI's check of GenerateReqInput (422), the contract gate (400 {"error": str}), io_struct.py /
    tokenizer_manager.py / SamplingParams.verify (400 {"error": {"message"}}); nothing reaches the engine."""
    client, engine, _ = _client(model)
    resp = client.post("/generate", json=body)
    assert resp.status_code == status, resp.text
    got = resp.json()
    if status == 422:
        assert message in json.dumps(got["detail"])
    elif isinstance(got["error"], str):  # the contract gate's shape
        assert got["error"] == message
    else:
        assert got["error"]["message"].startswith(message), got
    assert engine.calls == []


def test_temperature_zero_is_greedy(model):
    """sampling_params.py __post_init__: temperature < 1e-6 -> temperature 1.0, top_k 1 (greedy); the engine runs
    it as the nucleus of one token, whatever the seed."""
    client, engine, _ = _client(model)
    assert (
        _gen(client, input_ids=[1, 2], sampling_params={"temperature": 0, "max_new_tokens": 1}).status_code
        == 200
    )
    assert (
        _gen(client, input_ids=[1, 2], sampling_params={"top_k": 1, "max_new_tokens": 1}).status_code == 200
    )
    assert [(p.temperature, p.top_p) for _, p in engine.calls] == [(1.0, GREEDY_TOP_P)] * 2
    from detrl.rollout.sampling import sample

    logp = torch.log_softmax(torch.randn(64, VOCAB), -1)  # float32, as the engine's log_probs
    logp[0, :2] = logp[0].max()  # a tie: argmax takes the first
    noise = -torch.log(-torch.log(torch.rand(64, VOCAB, dtype=torch.float64)))
    assert torch.equal(sample(logp, noise, GREEDY_TOP_P), logp.argmax(-1))


def test_limits_on_body_and_sequences(model):
    client, engine, _ = _client(model, max_request_items=4, max_body_bytes=2000)
    many = _gen(client, input_ids=[[1]] * 3, sampling_params={"n": 2})
    assert many.status_code == 400 and "at most 4" in many.json()["error"]["message"]
    big = client.post(
        "/generate",
        content=json.dumps({"input_ids": [[1] * 1000]}),
        headers={"content-type": "application/json"},
    )
    assert big.status_code == 413 and "--max-body-bytes" in big.json()["error"]["message"]
    assert engine.calls == [] and _gen(client, input_ids=[[1]] * 4).status_code == 200


def _checkpoint(d: Path, tensors: dict) -> str:
    save_weights(tensors, d)
    return str(d)


def test_weight_update_with_mismatching_names_fails_and_keeps_the_old_weights(model):
    """model_executor/.../weight_updater.py: a failed load answers 400 {success: false, message: "Failed to
    update weights: ...\\nRolling back to original weights."}; nothing of it is applied (all or nothing).
    models/qwen3.py load_weights: a shard name (q_proj) the model lacks is a KeyError of its fused name; a
    wholly unknown name is skipped with a warning, and the load succeeds."""
    client, engine, server = _client(model)
    before = {k: v.clone() for k, v in server.model.state_dict().items()}
    good = {k: torch.zeros_like(v) for k, v in server.model.state_dict().items()}
    with tempfile.TemporaryDirectory() as d:
        bad = {**good, "model.layers.0.self_attn.q_proj.weight_renamed": torch.zeros(2, 2)}
        resp = client.post("/update_weights_from_disk", json={"model_path": _checkpoint(Path(d), bad)})
        assert resp.status_code == 400 and resp.json()["success"] is False
        assert resp.json()["message"] == (
            "Failed to update weights: 'model.layers.0.self_attn.qkv_proj.weight_renamed'.\n"
            "Rolling back to original weights."
        )
        shape = {**good, "model.norm.weight": torch.zeros(3)}
        resp = client.post("/update_weights_from_disk", json={"model_path": _checkpoint(Path(d), shape)})
        assert (
            resp.status_code == 400 and "Attempted to load weight (torch.Size([3]))" in resp.json()["message"]
        )
        for k, v in server.model.state_dict().items():
            assert torch.equal(v, before[k]), k  # the zeros of the valid tensors were not applied either
        assert engine.updates == 0
        unknown = {"lm_head.extra_scale_bias_x": torch.zeros(2)}
        resp = client.post("/update_weights_from_disk", json={"model_path": _checkpoint(Path(d), unknown)})
        assert resp.status_code == 200 and resp.json()["success"] is True and engine.updates == 1


def test_weight_update_does_not_say_whether_a_path_outside_the_root_exists(model, tmp_path):
    with tempfile.TemporaryDirectory() as root:
        client, engine, _ = _client(model, weights_root=root)
        answers = [
            client.post("/update_weights_from_disk", json={"model_path": p}).json()
            for p in (str(tmp_path), str(tmp_path / "missing"), "/etc", f"{root}/../etc")
        ]
        assert all(a["success"] is False for a in answers)
        assert len({a["message"] for a in answers}) == 1 and "--weights-root" in answers[0]["message"]
        inside = client.post("/update_weights_from_disk", json={"model_path": f"{root}/missing"}).json()
        assert "Cannot find any model weights" in inside["message"] and engine.updates == 0


@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(200, text="<html>proxy error</html>"),
        httpx.Response(200, json=[{"text": ""}]),
        httpx.Response(200, json=[]),
        httpx.Response(200, json={"detail": "x"}),
    ],
    ids=["not-json", "no-meta-info", "empty-list", "a-dict"],
)
def test_the_client_refuses_an_answer_that_is_not_sglangs_in_one_line(answer):
    eng = SGLangEngine.__new__(SGLangEngine)
    eng.params, eng.retries, eng.backoff_s = SamplingParams(max_new_tokens=2), 0, 0.0
    eng.client = httpx.Client(transport=httpx.MockTransport(lambda request: answer))
    with pytest.raises(ServerError) as e:
        eng._run("http://127.0.0.1:9", [Request(0, 0, (1, 2), 3)])
    assert "\n" not in str(e.value) and "rollout server" in str(e.value)


def test_an_unreachable_server_is_named_on_stderr_while_waiting(monkeypatch, capsys):
    from detrl.config import SGLangConfig
    from detrl.rollout.sglang import client

    assert SGLangConfig().health_timeout_s <= 120  # was 600 s of silence
    monkeypatch.setattr(client, "HEALTH_PROGRESS_S", 0.5)
    url = "http://127.0.0.1:9"  # discard port: nothing answers
    with pytest.raises(ServerError, match="127.0.0.1:9 is not healthy after 2 s"):
        SGLangEngine([url], SamplingParams(), True, health_timeout_s=2.0)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("detrl: waiting")]
    assert len(lines) >= 2 and all(url in line and "health_timeout_s" in line for line in lines)


def test_the_stand_in_binds_to_loopback_unless_told_otherwise():
    from detrl.rollout.sglang.app import _parser

    args = _parser().parse_args([])
    assert args.host == "127.0.0.1" and args.weights_root == tempfile.gettempdir()
    assert (args.max_request_items, args.max_body_bytes) == (1024, 8 << 20)
