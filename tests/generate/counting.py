"""Count the calls that build or look up a decode step, in this process (a test's or a rank's).

``generate``'s decode prepares each layer's attention once per session; these counters show it:
the builders and the public entry points' cache look-ups are wrapped to count their calls, and
the token step (``decode.TokenStep``) records the counts once it is built, so a test compares
"after the session's build" with "after every token".
"""

from __future__ import annotations

import functools
from collections import Counter
from contextlib import contextmanager
from typing import Any

# (module, attribute): functions and constructors whose calls are counted. prepared_decode is
# wrapped in every module that imported it by name.
COUNTED = (
    ("tree_attn.kernels.prepared", "prepared_decode"),
    ("tree_attn.kernels.dispatch", "prepared_decode"),
    ("tree_attn.reduce.collectives", "prepared_decode"),
    ("tree_attn.reduce.ring", "prepared_decode"),
    ("tree_attn.reduce.collectives", "_cached_merge"),
    ("tree_attn.reduce.collectives", "_new_merge"),
    ("tree_attn.reduce.collectives", "tree_decode"),
    ("tree_attn.reduce.ring", "ring_decode"),
    ("tree_attn.kernels.prepared", "PreparedDecode.__init__"),
    ("tree_attn.kernels.prepared", "DecodeStep.__init__"),
    ("tree_attn.reduce.collectives", "TreeDecoder.__init__"),
    ("tree_attn.reduce.collectives", "TreeDecodeStep.__init__"),
    ("tree_attn.reduce.ring", "RingDecodeStep.__init__"),
)


def _key(module: str, attr: str) -> str:
    return attr if "." in attr else f"{module.rsplit('.', 1)[-1]}.{attr}"


@contextmanager
def counting_calls():
    """Within: every call of :data:`COUNTED` adds one to ``counts[name]`` (name: ``Class.__init__``
    or ``module.function``), and ``built`` holds the counts as each token step finished building.
    Yields ``(counts, built)``; everything is restored on exit."""
    import importlib

    from tree_attn.commands.generate import decode

    counts: Counter = Counter()
    built: list[Counter] = []
    undo: list[tuple[Any, str, Any]] = []

    def wrap(owner, name: str, key: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            counts[key] += 1
            return original(*args, **kwargs)

        undo.append((owner, name, original))
        setattr(owner, name, counted)

    for module_name, attr in COUNTED:
        module = importlib.import_module(module_name)
        if "." in attr:
            cls_name, name = attr.split(".")
            wrap(getattr(module, cls_name), name, attr)
        else:
            wrap(module, attr, _key(module_name, attr))

    base = decode.TokenStep

    class RecordingTokenStep(base):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            built.append(Counter(counts))

    undo.append((decode, "TokenStep", base))
    decode.TokenStep = RecordingTokenStep
    try:
        yield counts, built
    finally:
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)
