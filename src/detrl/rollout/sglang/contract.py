"""SGLang's type checks of a /generate body, the two it runs before the request reaches the tokenizer manager.

1. FastAPI parses the body into `GenerateReqInput` (managers/io_struct.py): a wrong type of `rid`, `input_ids`,
   `sampling_params` or `return_logprob` is HTTP 422 {"detail": [...]} (pydantic's errors). `GenerateBody` declares
   those fields with SGLang's own annotations, so FastAPI answers them the same way.
2. entrypoints/http_server.py `generate_request` -> entrypoints/api_contract.py `generate_contract_error`: the
   JSON is decoded against the schema (sglang/api/v1/api_types.py `decode_GenerateRequest`) and a violation is
   HTTP 400 {"error": "<serde's text>"}. `contract_error` gives the same text for every field the schema types
   with scalars and lists (tests/test_sglang_contract.py compares it with SGLang's on hostile bodies).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

# GenerateBody keeps SGLang's annotations verbatim (Optional / Union / List): its 422s are pydantic's of those
# ruff: noqa: UP006, UP007, UP035, UP045
from typing import Annotated, Any, Callable, Dict, List, Optional, Union

from pydantic import PlainValidator


def _list_i64(v: Any) -> list[int]:
    """utils/field_validators.py `validate_list_i64_1d`."""
    if v is None:
        raise ValueError("must not be None")
    if not isinstance(v, list):
        raise ValueError(f"must be list; got {type(v).__name__}")
    if not v:
        return v
    if not isinstance(v[0], int):
        raise ValueError(f"elements must be int; got {type(v[0]).__name__}")
    try:
        array("q", v)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"contains non-int64 element: {e}") from None
    return v


def validate_optional_list_i64_1d_2d(v: Any) -> list[int] | list[list[int]] | None:
    """utils/field_validators.py `validate_optional_list_i64_1d_2d` (GenerateReqInput.input_ids' validator)."""
    if v is None or (isinstance(v, list) and not v):
        return v
    if not isinstance(v, list):
        raise ValueError(f"must be list or null; got {type(v).__name__}")
    if isinstance(v[0], int):
        return _list_i64(v)
    if isinstance(v[0], list):
        for i, row in enumerate(v):
            try:
                _list_i64(row)
            except ValueError as e:
                raise ValueError(f"row {i}: {e}") from None
        return v
    raise ValueError(f"elements must be int or list; got {type(v[0]).__name__}")


@dataclass
class GenerateBody:
    """The fields of io_struct.py GenerateReqInput that FastAPI checks before SGLang reads them (same annotations)."""

    rid: Optional[Union[str, List[str]]] = None
    text: Optional[Union[List[str], str]] = None
    input_ids: Annotated[
        Optional[Union[List[List[int]], List[int]]],
        PlainValidator(validate_optional_list_i64_1d_2d),
    ] = None
    sampling_params: Optional[Union[List[Dict[str, Any]], Dict[str, Any]]] = None
    return_logprob: Optional[Union[List[bool], bool]] = None
    stream: bool = False


class ContractError(ValueError):
    """api_types.py JsonContractError: an HTTP 400 {"error": str(e)}."""


def _unexpected(v: Any) -> str:
    """api_types.py `_unexpected` (serde's Unexpected display)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map" if isinstance(v, dict) else type(v).__name__


def _expect(ok: Callable[[Any], bool], expected: str) -> Callable[[Any], Any]:
    def check(v: Any, expected: str = expected) -> Any:
        if not ok(v):
            raise ContractError(f"invalid type: {_unexpected(v)}, expected {expected}")
        return v

    return check


_int = _expect(lambda v: isinstance(v, int) and not isinstance(v, bool), "i64")
_float = _expect(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "f64")
_bool = _expect(lambda v: isinstance(v, bool), "a boolean")
_str = _expect(lambda v: isinstance(v, str), "a string")
_seq = _expect(lambda v: isinstance(v, list), "a sequence")
_map = _expect(lambda v: isinstance(v, dict), "a map")


def _list_of(item: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: [item(e) for e in _seq(v)]


def _or_list(item: Callable[[Any], Any], name: str) -> Callable[[Any], Any]:
    """api_types.py decode_<X>OrList: a list is decoded item by item, else one value."""
    return lambda v: (
        _list_of(item)(v) if isinstance(v, list) else item(v, f"a value or an array of values for {name}")
    )


def _token_ids_or_list(v: Any) -> Any:
    """api_types.py `decode_TokenIdsOrList`: [] and [number, ...] are one prompt, anything else a batch."""
    if not isinstance(v, list):
        raise ContractError(
            f"invalid type: {_unexpected(v)}, expected a value or an array of values for TokenIdsOrList"
        )
    if not v or (isinstance(v[0], (int, float)) and not isinstance(v[0], bool)):
        return _list_of(_int)(v)
    return _list_of(_list_of(_int))(v)


# api_types.py _FIELDS_SamplingParams, in its order (the unknown-field message lists them so)
_SAMPLING_KINDS: dict[str, Callable[[Any], Any]] = {
    "max_new_tokens": _int,
    "stop": _or_list(_str, "StringOrList"),
    "stop_token_ids": _list_of(_int),
    "stop_regex": _or_list(_str, "StringOrList"),
    **dict.fromkeys(("temperature", "top_p"), _float),
    "top_k": _int,
    "min_p": _float,
    **dict.fromkeys(("frequency_penalty", "presence_penalty", "repetition_penalty"), _float),
    "min_new_tokens": _int,
    "n": _int,
    **dict.fromkeys(("json_schema", "regex", "ebnf", "structural_tag"), _str),
    **dict.fromkeys(
        ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"), _bool
    ),
    "stream_interval": _int,
    "logit_bias": lambda v: {k: _float(e) for k, e in _map(v).items()},
    "sampling_seed": _int,
    "custom_params": lambda v: v,
    "beam_width": _int,
    "watermark": lambda v: v,  # a struct of its own: detrl.serve refuses any watermark later
    "choice": _list_of(_str),
}


def _sampling_params(v: Any, expected: str = "struct SamplingParams") -> dict:
    """api_types.py `decode_SamplingParams`: typed fields, an unknown one refused (serde's unknown_field)."""
    for key, x in _expect(lambda m: isinstance(m, dict), expected)(v).items():
        if key not in _SAMPLING_KINDS:
            listed = ", ".join(f"`{f}`" for f in _SAMPLING_KINDS)
            raise ContractError(f"unknown field `{key}`, expected one of {listed}")
        if x is not None:
            _SAMPLING_KINDS[key](x)
    return v


def _sampling_params_or_list(v: Any) -> Any:
    if isinstance(v, list):
        return [_sampling_params(e) for e in v]
    return _sampling_params(v, "a value or an array of values for SamplingParamsOrList")


# api_types.py decode_GenerateRequest, the fields typed with scalars and lists (others are refused by name later)
_GENERATE_KINDS: dict[str, Callable[[Any], Any]] = {
    **dict.fromkeys(("rid", "text", "extra_key", "cache_salt"), _or_list(_str, "StringOrList")),
    **dict.fromkeys(("input_ids", "token_ids_logprob"), _token_ids_or_list),
    "stream": _bool,
    "sampling_params": _sampling_params_or_list,
    **dict.fromkeys(("return_logprob", "return_hidden_states"), _or_list(_bool, "BoolOrList")),
    "return_sampling_mask": _or_list(_bool, "BoolOrList"),
    **dict.fromkeys(("logprob_start_len", "top_logprobs_num"), _or_list(_int, "Int64OrList")),
    **dict.fromkeys(("return_text_in_logprobs", "require_reasoning"), _bool),
    **dict.fromkeys(("routed_dp_rank", "disagg_prefill_dp_rank", "priority"), _int),
    **dict.fromkeys(("routing_key", "session_id"), _str),
}
_NOT_NULL = {"return_prompt_token_ids": _bool, "routed_experts_start_len": _int}  # decoded even when null


def contract_error(body: Any) -> str | None:
    """entrypoints/api_contract.py `generate_contract_error`: the contract violation of a /generate body, or None."""
    try:
        for key, x in _expect(lambda m: isinstance(m, dict), "struct GenerateRequest")(body).items():
            if key in _NOT_NULL:
                _NOT_NULL[key](x)
            elif key in _GENERATE_KINDS and x is not None:
                _GENERATE_KINDS[key](x)
    except ContractError as e:
        return str(e)
    return None
