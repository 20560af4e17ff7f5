"""A file a loader must refuse with one clear error: write it, load it, return what was raised."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def refused(load: Callable[[Path], Any], path: Path, content: str | bytes, error: type[Exception],
            match: str | None = None) -> str:
    """Write ``content`` to ``path``; check that ``load(path)`` raises ``error`` (its message
    matching the regex ``match`` when given) and return the message."""
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(error, match=match) as info:
        load(path)
    return str(info.value)
