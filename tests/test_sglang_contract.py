"""Contract tests against SGLang's own classes (installed with --no-deps: ServerArgs and SamplingParams)."""

import os

import pytest
import torch

from detrl.config import ConfigError
from detrl.rollout.base import Request, SamplingParams
from detrl.rollout.sglang import SGLangEngine
from detrl.rollout.sglang_launch import check_server_args, server_argv, sglang_dtype

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
    sa = check_server_args(argv)
    assert sa.model_path == "/models/tiny" and sa.port == 30010 and sa.random_seed == 7
    assert bool(sa.enable_deterministic_inference) == deterministic
    if deterministic:
        assert sa.attention_backend == "triton" and sa.rl_on_policy_target == "fsdp"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_dtype_we_pass_parses_and_serves_the_policys_dtype(dtype):
    """SGLang's default --dtype auto serves a float32 checkpoint as float16: we pass the policy's dtype."""
    argv = server_argv("/models/tiny", 30013, 0, True, "triton", dtype=sglang_dtype(dtype))
    sa = check_server_args(argv)
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

    from detrl.serve import Server, make_app

    sa = check_server_args(server_argv("/m", 30014, 0, True, "triton"))
    known = set(sa.resolved_dict()) | {
        "launch_command",
        "startup_time",
        "internal_states",
        "version",
        "frontend",
    }
    server = Server(SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace())), "/m", True, 0, 16)
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
