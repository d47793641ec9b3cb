"""Name -> function registries for the algorithm variants (policy losses, advantage estimators).

One registry is the one list of valid names: the decorator refuses a duplicate, a lookup of an unknown name
fails in one line listing the registered ones, and `detrl.config.validate` checks names against the same dict.
"""

from __future__ import annotations

from collections.abc import Callable


class Registry(dict):
    """A dict of name -> function with a registering decorator and a one-line error for unknown names."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what  # the config key the names are chosen by, for error messages

    def register(self, name: str) -> Callable[[Callable], Callable]:
        def deco(fn: Callable) -> Callable:
            if name in self:
                raise ValueError(f"{self.what} {name!r} is already registered")
            self[name] = fn
            return fn

        return deco

    def get_fn(self, name: str) -> Callable:
        if name not in self:
            raise ValueError(f"{self.what}={name!r} is not valid; choose one of {list(self)}")
        return self[name]
