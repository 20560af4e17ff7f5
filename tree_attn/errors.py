"""Errors raised by tree-attn.

Library code raises a :class:`TreeAttnError` subclass whose message says what went wrong and what
to do about it; only ``tree_attn.cli`` turns these into an exit code and a one-line message.
"""

from __future__ import annotations


class TreeAttnError(Exception):
    """Base class of every error tree-attn raises on purpose."""


class ShapeError(TreeAttnError, ValueError):
    """Tensors of the wrong shape, dtype or device for the operation."""


class ConfigError(TreeAttnError, ValueError):
    """A bad option: unknown strategy, fan-out out of range, bad kernel config."""


class DistributedError(TreeAttnError, RuntimeError):
    """A collective failed: a rank died, timed out, or ranks disagree on shapes."""


class TopologyError(TreeAttnError):
    """The GPU fabric could not be read or a topology dump could not be parsed."""


class ProfileError(TreeAttnError):
    """A profile is malformed, for another machine, or cannot be written."""


class KernelUnavailableError(TreeAttnError, RuntimeError):
    """The requested kernel implementation cannot run on these tensors or this machine."""
