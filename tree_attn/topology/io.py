"""YAML save/load of topologies, and reading an "expected" topology from any file a user has.

Files are written atomically (a temporary file in the same folder, then a rename) so that a crash
never leaves half a topology behind, with the mode the umask gives; read with
:func:`tree_attn.files.load_yaml` (``yaml.safe_load`` without anchors or aliases).
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from ..errors import TopologyError
from ..files import YAMLAliasError, load_yaml, yaml_problem
from ..files import atomic_write_text as _atomic_write_text
from .model import Topology


def atomic_write_text(path: str | os.PathLike, text: str, *, force: bool = True) -> None:
    """Write ``text`` to ``path`` atomically (:func:`tree_attn.files.atomic_write_text`); an
    existing file is replaced only with ``force``. Failures are TopologyErrors."""
    path = os.fspath(path)
    try:
        _atomic_write_text(path, text, replace=force)
    except FileExistsError:
        raise TopologyError(f"{path} already exists; pass --force to overwrite it") from None
    except OSError as exc:
        raise TopologyError(f"cannot write {path!r}: {exc.strerror or exc}") from None


def topology_to_yaml(topo: Topology) -> str:
    """YAML text of a topology, keys in the stable order of ``Topology.to_dict``."""
    return yaml.safe_dump(topo.to_dict(), sort_keys=False, default_flow_style=None, width=100)


def save_topology(topo: Topology, path: str | os.PathLike, *, force: bool = True) -> None:
    """Write a topology as YAML, atomically; an existing file is replaced only with ``force``."""
    atomic_write_text(path, topology_to_yaml(topo), force=force)


def _read_yaml(path: str | os.PathLike) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return load_yaml(f)
    except OSError as exc:
        raise TopologyError(f"cannot read {os.fspath(path)!r}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise TopologyError(f"{os.fspath(path)}: not valid YAML ({yaml_problem(exc)})") from None


def load_topology(path: str | os.PathLike) -> Topology:
    """Read a topology YAML written by :func:`save_topology` (or a YAML with a top-level
    ``topology`` key holding one, as profiles have)."""
    data = _read_yaml(path)
    return topology_from_obj(data, where=os.fspath(path))


def topology_from_obj(data: Any, *, where: str = "topology") -> Topology:
    """A Topology from a loaded YAML/JSON object: a topology dict, or a mapping whose
    ``topology`` key holds one."""
    if isinstance(data, dict) and "topology" in data and isinstance(data["topology"], dict):
        data = data["topology"]
    try:
        return Topology.from_dict(data)
    except TopologyError as exc:
        raise TopologyError(f"{where}: {exc}") from None


def load_expected(path: str | os.PathLike) -> Topology:
    """What ``tree-attn check --expect`` accepts: a saved topology YAML, a profile YAML with a
    ``topology`` section, or a recorded dump (``nvidia-smi topo -m`` ...)."""
    from .dumps import load_dump

    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as exc:
        raise TopologyError(f"cannot read {os.fspath(path)!r}: {exc.strerror or exc}") from None
    data: Any = None
    try:
        data = load_yaml(text)
    except YAMLAliasError as exc:
        raise TopologyError(f"{os.fspath(path)}: {yaml_problem(exc)}") from None
    except yaml.YAMLError:
        data = None  # a dump is usually not YAML; fall through to the dump parsers
    if isinstance(data, dict) and ("topology" in data or "schema_version" in data):
        if isinstance(data.get("topology"), dict) or "schema_version" in data:
            return topology_from_obj(data, where=os.fspath(path))
        raise TopologyError(
            f"{os.fspath(path)}: the 'topology' section is not a topology mapping; "
            "write one with `tree-attn probe --output FILE`"
        )
    return load_dump(path)
