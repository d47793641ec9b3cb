"""Contract tests against SGLang's own classes (installed with --no-deps: ServerArgs and SamplingParams)."""

import os

import pytest
import torch

from detrl.config import ConfigError
from detrl.rollout.base import Request, SamplingParams
from detrl.rollout.sglang import SGLangEngine
from detrl.rollout.sglang.launch import check_server_args, parse_server_args, server_argv, sglang_dtype

if os.environ.get("DETRL_REQUIRE_SGLANG"):  # `make test` (and so CI) installs SGLang's classes: they must run
    import sglang
else:
    sglang = pytest.importorskip("sglang", reason="SGLang's classes are installed by `make test` (--no-deps)")


@pytest.mark.parametrize("deterministic", [True, False], ids=["on", "off"])
def test_our_launch_arguments_parse_and_resolve_with_sglang(deterministic):
    argv = server_argv(
        "/models/tiny",
        30010,
        seed=7,
        deterministic=deterministic,
        attention_backend="triton",
        rl_on_policy_target=deterministic,
    )
    sa = parse_server_args(argv)
    assert sa.model_path == "/models/tiny" and sa.port == 30010 and sa.random_seed == 7
    assert bool(sa.enable_deterministic_inference) == deterministic
    if deterministic:
        assert sa.attention_backend == "triton" and sa.rl_on_policy_target == "fsdp"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_dtype_we_pass_parses_and_serves_the_policys_dtype(dtype):
    """SGLang's default --dtype auto serves a float32 checkpoint as float16: we pass the policy's dtype."""
    argv = server_argv("/models/tiny", 30013, 0, True, "triton", dtype=sglang_dtype(dtype))
    sa = parse_server_args(argv)
    assert sa.dtype == str(dtype).removeprefix("torch.")
    info = sa.resolved_dict()  # what /server_info reports (utils/common.py build_server_info)
    assert info["dtype"] == sa.dtype and info["enable_deterministic_inference"] is True
    with pytest.raises(ConfigError, match="float64"):
        sglang_dtype(torch.float64)


def test_detrl_serve_reports_only_server_args_fields_and_sglangs_routes():
    """Every /server_info field detrl.serve reports is a ServerArgs field (or one http_server.py adds), and every
    route it answers is one SGLang's http_server.py declares, with the same methods."""
    import re
    from pathlib import Path
    from types import SimpleNamespace

    from detrl.rollout.sglang.app import make_app
    from detrl.rollout.sglang.server import Server

    sa = parse_server_args(server_argv("/m", 30014, 0, True, "triton"))
    known = set(sa.resolved_dict()) | {
        "launch_command",
        "startup_time",
        "internal_states",
        "version",
        "frontend",
    }
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=64))
    server = Server(SimpleNamespace(), model, "/m", True, 0, 16)
    assert set(server.server_info()) <= known

    src = (Path(sglang.__file__).parent / "srt/entrypoints/http_server.py").read_text()
    theirs: dict[str, set[str]] = {}
    for kind, path, methods in re.findall(
        r'@app\.(get|post|api_route)\(\s*"([^"]+)"(?:,\s*methods=\[([^\]]*)\])?', src
    ):
        ms = {kind.upper()} if kind != "api_route" else set(re.findall(r'"(\w+)"', methods))
        theirs.setdefault(path, set()).update(ms)
    for route in make_app(server).routes:
        if route.path in ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"):
            continue
        assert route.path in theirs and set(route.methods) - {"HEAD"} <= theirs[route.path], route.path


def test_our_generate_body_passes_sglangs_contract_check():
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    eng = SGLangEngine.__new__(SGLangEngine)
    eng.params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4, stop_token_ids=(2,))
    batch = [Request(11, 0, (1, 5, 11), 123), Request(11, 1, (1, 5, 11), 456, (7,), 1)]
    first, second = eng._payload(batch), eng._payload(batch)
    assert generate_contract_error(first) is None
    assert not set(first["rid"]) & set(second["rid"])  # a retry never reuses a rid SGLang may still hold


def test_an_argument_the_installed_sglang_lacks_fails_in_one_line():
    argv = server_argv("/m", 30011, 0, True, "triton", extra=["--enable-time-travel"])
    with pytest.raises(ConfigError) as e:
        check_server_args(argv)
    assert "--enable-time-travel" in str(e.value) and sglang.__version__ in str(e.value)
    assert "\n" not in str(e.value)


def test_a_bad_choice_is_caught_before_launch():
    with pytest.raises(ConfigError, match=sglang.__version__):
        check_server_args(server_argv("/m", 30012, 0, True, "no-such-backend"))


def test_our_sampling_params_pass_sglang_verify():
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

    eng = SGLangEngine.__new__(SGLangEngine)  # only the payload builder, no server
    eng.params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=4, stop_token_ids=(2,))
    payload = eng._payload([Request(11, 0, (1, 5, 11), 123), Request(11, 1, (1, 5, 11), 456, (7,), 1)])
    for sp in payload["sampling_params"]:
        obj = SGLangSamplingParams(**sp)
        obj.verify(64)
        assert obj.sampling_seed == sp["sampling_seed"]
    assert payload["sampling_params"][1]["max_new_tokens"] == 1
    with pytest.raises(ValueError):
        SGLangSamplingParams(**{**payload["sampling_params"][0], "top_p": 0.0}).verify(64)


def test_the_makefile_installs_every_module_sglang_imports():
    """`make test` installs SGLang with --no-deps: a module it imports that the Makefile does not name arrives only
    by accident (psutil did, through another package, on one machine and not on another)."""
    import re
    from pathlib import Path

    from tests.sglang_imports import distributions

    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    named = set(
        re.search(r"SGLANG_IMPORTS := ((?:.*\\\n)*.*)", makefile).group(1).replace("\\\n", " ").split()
    )
    assert distributions() <= named, (
        f"add to SGLANG_IMPORTS in the Makefile: {sorted(distributions() - named)}"
    )


# ---------------------------------------------------------------- detrl.serve's checks against SGLang's own

HOSTILE_BODIES = [
    {"input_ids": 5},
    {"input_ids": [["a"]]},
    {"input_ids": [[1, 2]], "rid": 123},
    {"input_ids": [[1, 2]], "rid": ["a", 5]},
    {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}},
    {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": "x"}},
    {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [1, "a"]}},
    {"input_ids": [1.5]},
    {"input_ids": [True]},
    {"input_ids": [], "rid": "r"},
    {"input_ids": [-5]},
    {"input_ids": [1], "sampling_params": {"n": "2"}},
    {"input_ids": [1], "sampling_params": {"max_new_tokens": 1.5}},
    {"input_ids": [1], "sampling_params": {"sampling_seed": "x"}},
    {"input_ids": [1], "sampling_params": {"bogus": 1}},
    {"input_ids": [1], "sampling_params": [{"n": 2}, 3]},
    {"input_ids": [1], "sampling_params": 5},
    {"input_ids": [1], "sampling_params": {"logit_bias": {"3": "x"}}},
    {"input_ids": [1], "sampling_params": {"temperature": None, "top_p": None}},
    {"input_ids": [1], "return_logprob": "yes"},
    {"input_ids": [1], "return_logprob": [True, 1]},
    {"input_ids": [1], "stream": 1},
    {"input_ids": [1], "priority": 1.0},
    {"input_ids": [1], "return_prompt_token_ids": None},
    {"input_ids": [1], "unknown_top_level": object()},
    [1, 2],
    "x",
    None,
    {"text": 7},
    {},
]


@pytest.mark.parametrize("body", HOSTILE_BODIES, ids=range(len(HOSTILE_BODIES)))
def test_the_contract_gate_answers_as_sglangs(body):
    """entrypoints/api_contract.py generate_contract_error is SGLang's 400 {"error": str}: ours gives its text."""
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    from detrl.rollout.sglang.contract import contract_error

    assert contract_error(body) == generate_contract_error(body)


SAMPLING = [
    {},
    {"temperature": 0},
    {"temperature": 1e-7, "top_p": 0.5},
    {"temperature": -1},
    {"temperature": float("inf")},
    {"temperature": float("nan")},
    {"top_p": 5},
    {"top_p": 0},
    {"top_p": 1.0000001},
    {"top_k": 0},
    {"top_k": -1},
    {"top_k": 1},
    {"min_p": 2},
    {"frequency_penalty": 3},
    {"presence_penalty": -2.5},
    {"repetition_penalty": 0},
    {"min_new_tokens": -1},
    {"min_new_tokens": 3},
    {"max_new_tokens": -1},
    {"max_new_tokens": None},
    {"max_new_tokens": 0, "stop_token_ids": [2, 2, None]},
    {"logit_bias": {"64": 1.0}},
    {"sampling_seed": 2**63},
    {"sampling_seed": -(2**63)},
    {"beam_width": 0},
    {"regex": "a", "ebnf": "b"},
    {"regex": "", "ebnf": "b"},
    {"stop": "x"},
    {"stop": ["a"] * 33},
    {"stop_regex": "a+"},
    {"temperature": None, "n": None, "ignore_eos": None},
]


@pytest.mark.parametrize("sp", SAMPLING, ids=range(len(SAMPLING)))
def test_sampling_checks_give_sglangs_messages_and_values(sp):
    """sampling_params.py SamplingParams(**sp).normalize(None).verify(vocab): the same refusal, word for word, or
    the same resolved temperature / top_p / top_k / max_new_tokens / stop ids (then ours may still refuse a knob
    the engine lacks, in one line naming it)."""
    from sglang.srt.sampling.sampling_params import SamplingParams as Theirs

    from detrl.rollout.sglang.requests import sampling

    try:
        theirs = Theirs(**sp)
        theirs.normalize(None)
        theirs.verify(64)
        want = None
    except ValueError as e:
        want = str(e)
    try:
        ours, got = sampling(sp, 64), None
    except ValueError as e:
        ours, got = None, str(e)
    if want is not None or got is None or not got.startswith("detrl.serve does not implement"):
        assert got == want
    if want is None and ours is not None:
        fields = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "ignore_eos", "n")
        assert {k: ours[k] for k in fields} == {k: getattr(theirs, k) for k in fields}


def test_generate_body_declares_sglangs_annotations_and_validator():
    """FastAPI's 422s come from GenerateReqInput's annotations (managers/io_struct.py): GenerateBody declares the
    fields detrl.serve reads with the same text, and the same input_ids validator."""
    import ast
    import dataclasses
    import inspect
    from pathlib import Path

    from sglang.srt.utils.field_validators import validate_optional_list_i64_1d_2d as theirs

    from detrl.rollout.sglang import contract

    def annotations(tree, name):
        cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
        return {n.target.id: ast.unparse(n.annotation) for n in cls.body if isinstance(n, ast.AnnAssign)}

    io_struct = Path(sglang.__file__).parent / "srt/managers/io_struct.py"
    sglang_fields = annotations(ast.parse(io_struct.read_text()), "GenerateReqInput")
    ours = annotations(ast.parse(inspect.getsource(contract)), "GenerateBody")
    assert set(ours) == {f.name for f in dataclasses.fields(contract.GenerateBody)}
    for name, text in ours.items():
        assert sglang_fields[name] == text, name
    for v in [None, [], [1, 2], [[1], []], 5, ["a"], [[1], ["a"]], [[1], 2], [2**64], [1.5], [True], "x"]:
        results = []
        for f in (theirs, contract.validate_optional_list_i64_1d_2d):
            try:
                results.append(("ok", f(v)))
            except ValueError as e:
                results.append(("error", str(e)))
        assert results[0] == results[1], v


def test_check_server_args_runs_sglangs_resolution_step():
    """--attention-backend torch_native parses, but SGLang's resolution (ServerArgs.resolve_once ->
    arg_groups/overrides.py _deterministic_attention_backend) refuses it with deterministic inference: the
    check runs that step. With SGLang installed --no-deps (CI) the step cannot import its dependencies, and the
    check says which one in one line instead of passing the arguments unresolved."""
    argv = server_argv("/m", 30015, 0, True, "torch_native")
    assert parse_server_args(argv).attention_backend == "torch_native"
    with pytest.raises(ConfigError) as e:
        check_server_args(argv)
    msg = str(e.value)
    assert "\n" not in msg and sglang.__version__ in msg
    import importlib

    try:
        importlib.import_module("sglang.srt.arg_groups.pipeline")  # SGLang with its dependencies
    except ImportError as missing:
        assert f"its dependency {missing.name} is not installed" in msg
    else:
        assert "attention backends are supported for deterministic inference" in msg and "torch_native" in msg


def test_the_resolution_leaves_the_trainers_environment_as_it_was(monkeypatch):
    """SGLang's resolution handlers may set environment variables for the server; the check restores ours."""
    from sglang.srt.server_args import ServerArgs

    def resolve(self):
        os.environ["DETRL_SET_BY_RESOLUTION"] = "1"
        raise ValueError("refused\nsecond line")

    monkeypatch.setattr(ServerArgs, "resolve_once", resolve)
    with pytest.raises(ConfigError, match="refuses the launch arguments: refused$"):
        check_server_args(server_argv("/m", 30016, 0, True, "triton"))
    assert "DETRL_SET_BY_RESOLUTION" not in os.environ
