"""Validation helpers for the profile schema: every error names its dotted field path.

A profile is read from YAML that people edit by hand, so each check says *which* field is wrong
(``reduction.plan.fanout``), what value it holds, and what was expected. Nested dataclasses get
their own path through an ``InitVar`` (``where``) so that an error deep inside a list
(``kernel.buckets[3].config.block_n``) still names the whole path.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from .errors import ProfileError


class FieldError(ProfileError):
    """A ProfileError about one field; ``path`` is its dotted path, ``detail`` what is wrong."""

    def __init__(self, path: str, detail: str) -> None:
        self.path = path
        self.detail = detail
        super().__init__(f"{path}: {detail}")


def join(where: str, name: str) -> str:
    """``join("reduction", "plan")`` -> ``"reduction.plan"``; list indices attach without a dot."""
    if not where:
        return name
    if name.startswith("["):
        return where + name
    return f"{where}.{name}"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _tname(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def check_mapping(
    data: Any,
    where: str,
    *,
    required: Iterable[str] = (),
    optional: Iterable[str] = (),
) -> Mapping[str, Any]:
    """``data`` must be a mapping with all ``required`` keys and no keys outside ``required`` and
    ``optional``; returns it."""
    what = where or "profile"
    if not isinstance(data, Mapping):
        raise FieldError(what, f"expected a mapping, got {_tname(data)} {_show(data)}")
    required = list(required)
    allowed = set(required) | set(optional)
    unknown = sorted(str(k) for k in data if k not in allowed)
    if unknown:
        raise FieldError(
            join(where, unknown[0]),
            f"unknown key (allowed here: {', '.join(sorted(allowed))})"
            + (f"; other unknown keys: {', '.join(unknown[1:])}" if len(unknown) > 1 else ""),
        )
    missing = [k for k in required if k not in data]
    if missing:
        raise FieldError(join(where, missing[0]), "required key is missing")
    return data


def check_str(value: Any, path: str, *, optional: bool = False, choices: Iterable[str] | None = None, nonempty: bool = True) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or (nonempty and not value.strip()):
        raise FieldError(path, f"expected a {'non-empty ' if nonempty else ''}string{' or null' if optional else ''}, got {_tname(value)} {_show(value)}")
    if choices is not None:
        choices = tuple(choices)
        if value not in choices:
            raise FieldError(path, f"expected one of {', '.join(choices)}, got {_show(value)}")


def check_int(value: Any, path: str, *, minimum: int | None = None, maximum: int | None = None, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(path, f"expected an integer{' or null' if optional else ''}, got {_tname(value)} {_show(value)}")
    if minimum is not None and value < minimum:
        raise FieldError(path, f"expected an integer >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise FieldError(path, f"expected an integer <= {maximum}, got {value}")


def check_number(value: Any, path: str, *, optional: bool = False, minimum: float = 0.0) -> None:
    """A finite number >= ``minimum`` (times, bandwidths: never negative, never NaN/inf)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldError(path, f"expected a number{' or null' if optional else ''}, got {_tname(value)} {_show(value)}")
    if not math.isfinite(value) or value < minimum:
        raise FieldError(path, f"expected a finite number >= {minimum:g}, got {value!r}")


def check_bool(value: Any, path: str) -> None:
    if not isinstance(value, bool):
        raise FieldError(path, f"expected true or false, got {_tname(value)} {_show(value)}")


def check_list(value: Any, path: str) -> list:
    if not isinstance(value, list):
        raise FieldError(path, f"expected a list, got {_tname(value)} {_show(value)}")
    return value


def check_str_list(value: Any, path: str) -> None:
    check_list(value, path)
    for i, item in enumerate(value):
        check_str(item, f"{path}[{i}]", nonempty=False)


def as_float(value: Any) -> Any:
    """Ints become floats (YAML writes ``12`` for 12.0) so round trips compare equal."""
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value
