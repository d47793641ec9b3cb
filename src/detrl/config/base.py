"""The error every bad setting raises, and the two helpers each group's `validate()` is written with."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """A bad setting. Its message is one line naming the value and the valid choices."""


def choice(where: str, value: Any, choices: Iterable) -> None:
    """Refuse `value` unless it is one of `choices` (a registry's names, a tuple or a dict's keys)."""
    choices = tuple(choices)
    if value not in choices:
        raise ConfigError(f"{where}={value!r} is not valid; choose one of {list(choices)}")


def check(ok: bool, where: str, value: Any, rule: str) -> None:
    """Refuse `value` at `where` unless `ok`, saying the `rule` it breaks."""
    if not ok:
        raise ConfigError(f"{where}={value!r} is not valid: {rule}")
