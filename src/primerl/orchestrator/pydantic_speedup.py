"""Remember which pydantic `default_factory` callables take the validated data, instead of asking `inspect` each time.

pydantic (2.14) decides whether a field's `default_factory` takes the validated data with `inspect.signature` on
every `model_construct` that fills a default, uncached. For a builtin factory (`list`, `time.time`) `inspect` parses
its text signature and copies `sys.modules`, tens of microseconds each; verifiers builds a trace's message nodes with
`model_construct` and builtin factories, several per turn, which made this the largest single CPU cost of a rollout
in the orchestrator (see `benchmarks/NOTES.md`). The answer depends only on the callable, so it is cached per
callable. pydantic caches it already for private attributes; remove this once it does for fields too.
"""

from __future__ import annotations

import functools


def cache_default_factory_checks() -> None:
    """Replace pydantic's per-call check by a cached one (idempotent; a no-op when pydantic no longer has it)."""
    from pydantic._internal import _fields

    check = getattr(_fields, "takes_validated_data_argument", None)
    if check is None or hasattr(check, "cache_info"):
        return
    cached = functools.lru_cache(maxsize=4096)(check)

    @functools.wraps(check)
    def takes_validated_data_argument(default_factory):
        try:
            return cached(default_factory)
        except TypeError:  # an unhashable callable: ask every time, as pydantic does
            return check(default_factory)

    takes_validated_data_argument.cache_info = cached.cache_info
    _fields.takes_validated_data_argument = takes_validated_data_argument
