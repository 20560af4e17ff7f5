"""The one validation vocabulary of tree-attn: checks that name the field, show the bad value and
say what was expected, raising the error class the caller chooses.

What is expected is said the same way everywhere ("an integer >= 1", "a positive number", "one of
tree, allreduce"), in one of two phrasings:

- a field of data (a profile, a topology, a parameters file), the default: ``machine.world_size:
  expected an integer >= 1, got 0``. Paths name nested fields (``kernel.buckets[3].config.block_n``,
  built with :func:`join`), so an error deep inside a hand-edited YAML file still names it;
- an argument or option (``must=True``): ``fanout must be an integer >= 2; got 1``.

``error`` is the :class:`~tree_attn.errors.TreeAttnError` subclass to raise (``ConfigError`` unless
the caller says otherwise). A class with ``takes_path = True`` (``profiles.schema.FieldError``) is
built as ``error(path, detail)`` and keeps the path apart; any other as ``error(message)``.

No torch, no imports beyond the errors: every package may use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

from .errors import ConfigError


def join(where: str, name: str) -> str:
    """``join("reduction", "plan")`` -> ``"reduction.plan"``; list indices attach without a dot."""
    if not where:
        return name
    if name.startswith("["):
        return where + name
    return f"{where}.{name}"


def show(value: Any) -> str:
    """``repr(value)``, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def type_name(value: Any) -> str:
    """The YAML-ish name of a value's type (``null`` for None)."""
    return "null" if value is None else type(value).__name__


def fail(error: type[Exception], path: str, detail: str) -> NoReturn:
    """Raise ``error`` about the field at ``path``: ``detail`` says what is wrong."""
    if getattr(error, "takes_path", False):
        raise error(path, detail)
    raise error(f"{path}: {detail}")


def _wrong(error: type[Exception], name: str, want: str, value: Any, *, must: bool, wrong_type: bool) -> NoReturn:
    if must:
        raise error(f"{name} must be {want}; got {value!r}")
    got = f"{type_name(value)} {show(value)}" if wrong_type else show(value)
    fail(error, name, f"expected {want}, got {got}")


def _or_null(want: str, optional: bool) -> str:
    return want + (" or null" if optional else "")


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool`` (True is an int to Python, never a count to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(
    value: Any,
    name: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    positive: bool = False,
    optional: bool = False,
    noun: str = "an integer",
    error: type[Exception] = ConfigError,
    must: bool = False,
) -> Any:
    """``value`` must be an int (never a bool) in ``minimum..maximum``; returns it.

    ``positive``: at least 1 (said "a positive integer"). ``optional``: None is accepted too.
    ``noun``: how the kind of number is named ("an integer"; "a whole number" for counts people
    type into files).
    """
    if value is None and optional:
        return None
    if positive:
        want = "a positive integer" if noun == "an integer" else f"{noun} >= 1"
        minimum = 1
    elif minimum is not None and maximum is not None:
        want = f"{noun} in {minimum}..{maximum}"
    elif minimum is not None:
        want = f"{noun} >= {minimum}"
    elif maximum is not None:
        want = f"{noun} <= {maximum}"
    else:
        want = noun
    if not is_int(value):
        _wrong(error, name, _or_null(want, optional), value, must=must, wrong_type=True)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        _wrong(error, name, want, value, must=must, wrong_type=False)
    return value


def check_number(
    value: Any,
    name: str,
    *,
    minimum: float = 0.0,
    maximum: float | None = None,
    positive: bool = False,
    finite: bool = True,
    optional: bool = False,
    error: type[Exception] = ConfigError,
    must: bool = False,
) -> Any:
    """``value`` must be a number (never a bool, never NaN) >= ``minimum`` (> 0 with ``positive``)
    and <= ``maximum``, finite unless ``finite=False``; returns it as a float (YAML writes ``12``
    for 12.0: round trips then compare equal), None when ``optional`` and None."""
    if value is None and optional:
        return None
    if positive:
        want = "a positive number" if maximum is None else f"a number in (0, {maximum:g}]"
    elif maximum is not None:
        want = f"a number in {minimum:g}..{maximum:g}"
    else:
        want = f"a number >= {minimum:g}"
    if not is_number(value):
        _wrong(error, name, _or_null(want, optional), value, must=must, wrong_type=True)
    if finite and not math.isfinite(value):
        _wrong(error, name, want.replace("a ", "a finite ", 1), value, must=must, wrong_type=False)
    low = not value > minimum if positive else not value >= minimum  # NaN is low
    if low or (maximum is not None and value > maximum):
        _wrong(error, name, want, value, must=must, wrong_type=False)
    return float(value)


def check_str(
    value: Any,
    name: str,
    *,
    optional: bool = False,
    choices: Iterable[str] | None = None,
    nonempty: bool = True,
    error: type[Exception] = ConfigError,
    must: bool = False,
) -> Any:
    """``value`` must be a string (not blank, unless ``nonempty=False``), one of ``choices`` if
    given; returns it."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or (nonempty and not value.strip()):
        want = _or_null(f"a {'non-empty ' if nonempty else ''}string", optional)
        _wrong(error, name, want, value, must=must, wrong_type=True)
    if choices is not None:
        choices = tuple(choices)
        if value not in choices:
            _wrong(error, name, f"one of {', '.join(choices)}", value, must=must, wrong_type=False)
    return value


def check_bool(value: Any, name: str, *, error: type[Exception] = ConfigError) -> bool:
    if not isinstance(value, bool):
        fail(error, name, f"expected true or false, got {type_name(value)} {show(value)}")
    return value


def check_list(value: Any, name: str, *, error: type[Exception] = ConfigError) -> list:
    if not isinstance(value, list):
        fail(error, name, f"expected a list, got {type_name(value)} {show(value)}")
    return value


def check_str_list(value: Any, name: str, *, error: type[Exception] = ConfigError) -> list:
    check_list(value, name, error=error)
    for i, item in enumerate(value):
        check_str(item, f"{name}[{i}]", nonempty=False, error=error)
    return value


def check_mapping(
    data: Any,
    where: str,
    *,
    required: Iterable[str] = (),
    optional: Iterable[str] = (),
    error: type[Exception] = ConfigError,
    what: str = "value",
) -> Mapping[str, Any]:
    """``data`` must be a mapping with all ``required`` keys and no keys outside ``required`` and
    ``optional``; returns it. An unknown key is named by its whole path; ``what`` names the
    mapping itself when ``where`` is empty (the top of a document)."""
    what = where or what
    if not isinstance(data, Mapping):
        fail(error, what, f"expected a mapping, got {type_name(data)} {show(data)}")
    required = list(required)
    allowed = set(required) | set(optional)
    unknown = sorted(str(k) for k in data if k not in allowed)
    if unknown:
        fail(
            error,
            join(where, unknown[0]),
            f"unknown key (allowed here: {', '.join(sorted(allowed))})"
            + (f"; other unknown keys: {', '.join(unknown[1:])}" if len(unknown) > 1 else ""),
        )
    missing = [k for k in required if k not in data]
    if missing:
        fail(error, join(where, missing[0]), "required key is missing")
    return data
