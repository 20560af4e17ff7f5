"""Reading and writing profile files, and where saved profiles live.

Profiles are YAML, read with :func:`tree_attn.files.load_yaml` (``yaml.safe_load`` without anchors
or aliases) and written in a stable key order, atomically (:func:`tree_attn.files.atomic_write_text`:
a temporary file in the target folder, then a rename, with the mode the umask gives) so that a
crash or a full disk never leaves half a profile behind, and an existing profile is never replaced
unless asked (``--force``).

Saved profiles live in the user's cache folder, one file per machine, named by the topology
fingerprint: ``$TREE_ATTN_PROFILE_DIR`` if set, else ``$XDG_CACHE_HOME/tree-attn/profiles``, else
``~/.cache/tree-attn/profiles``.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..errors import ProfileError
from ..files import atomic_write_text, load_yaml
from .schema import Profile

PROFILE_DIR_ENV = "TREE_ATTN_PROFILE_DIR"
PROFILE_SUFFIX = ".yaml"


class _ProfileDumper(yaml.SafeDumper):
    """Flow style (``{a: 1, b: 2}``) for small mappings and lists of plain values (configs, plans,
    devices, links), block style for the rest, so that long notes read as one item per line."""

    def represent_mapping(self, tag, mapping, flow_style=None):
        return super().represent_mapping(tag, mapping, flow_style=_flow(mapping.values()))

    def represent_sequence(self, tag, sequence, flow_style=None):
        return super().represent_sequence(tag, sequence, flow_style=_flow(sequence))


def _flow(values) -> bool:
    values = list(values)
    return bool(values) and all(
        v is None or isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= 80) for v in values
    )


def profile_to_yaml(profile: Profile) -> str:
    """YAML text of a profile, keys in the stable order of :meth:`Profile.to_dict`."""
    return yaml.dump(profile.to_dict(), Dumper=_ProfileDumper, sort_keys=False, width=100, allow_unicode=True)


def _topology_instead(text: str, data: Any, source: str) -> str | None:
    """The error for a topology handed in as a profile (a saved ``probe --output`` YAML or a
    recorded dump): its keys or lines are no profile's, and a list of unknown keys says nothing
    of the mix-up. None when the text is not a topology either."""
    what = None
    if isinstance(data, dict) and "devices" in data and "links" in data and "machine" not in data:
        what = "a topology (as `tree-attn probe --output` writes it)"
    elif not (isinstance(data, dict) and ("schema_version" in data or "machine" in data)):
        from ..errors import TopologyError
        from ..topology.dumps import detect_format

        try:
            what = f"a recorded topology dump ({detect_format(text)})"
        except TopologyError:
            return None
    if what is None:
        return None
    arg = shlex.quote(source)
    return (f"{source}: this is {what}, not a profile: `tree-attn tune --topology {arg}` derives a profile from "
            f"it (and `tree-attn check --expect {arg}` checks a machine against it)")


def profile_from_yaml(text: str, *, source: str = "<profile>") -> Profile:
    """Parse and validate profile YAML; errors are ProfileErrors that start with ``source``."""
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        instead = _topology_instead(text, None, source)
        if instead:
            raise ProfileError(instead) from None
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ProfileError(f"{where}: not valid YAML ({problem}); "
                           "fix the file or re-tune with `tree-attn tune --force`") from None
    instead = _topology_instead(text, data, source)
    if instead:
        raise ProfileError(instead)
    if data is None:
        raise ProfileError(f"{source}: the file is empty; re-tune with `tree-attn tune --force`")
    try:
        return Profile.from_dict(data)
    except ProfileError as exc:
        raise ProfileError(f"{source}: {exc}") from None


def load_profile(path: str | os.PathLike) -> Profile:
    """Read and validate a profile file. Any problem (missing file, YAML syntax, a bad field)
    raises a ProfileError naming the file and, for a bad field, its dotted path."""
    p = os.fspath(path)
    try:
        with open(p, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ProfileError(f"{p}: no such profile file; list profiles with `tree-attn profiles`") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"cannot read profile {p}: {getattr(exc, 'strerror', None) or exc}") from None
    return profile_from_yaml(text, source=p)


def save_profile(profile: Profile, path: str | os.PathLike, *, force: bool = False) -> Path:
    """Write ``profile`` to ``path`` atomically and return the path.

    An existing file is left untouched unless ``force``: the ProfileError says to pass ``--force``.
    The folder is created if needed.
    """
    if not isinstance(profile, Profile):
        raise ProfileError(f"save_profile: expected a Profile, got {type(profile).__name__}")
    target = Path(os.fspath(path))
    text = profile_to_yaml(profile)
    if target.exists() and not force:
        raise _exists_error(target)
    try:
        atomic_write_text(target, text, replace=force)
    except FileExistsError:
        raise _exists_error(target) from None
    except OSError as exc:
        raise ProfileError(f"cannot write profile {target}: {exc.strerror or exc}") from None
    return target


def _exists_error(target: Path) -> ProfileError:
    return ProfileError(
        f"{target} already exists; pass --force to overwrite it (or write elsewhere with --output FILE)"
    )


# -- the profile folder ------------------------------------------------------------------------


def default_profile_dir() -> Path:
    """Where saved profiles live: ``$TREE_ATTN_PROFILE_DIR``, else
    ``$XDG_CACHE_HOME/tree-attn/profiles``, else ``~/.cache/tree-attn/profiles``."""
    override = os.environ.get(PROFILE_DIR_ENV)
    if override:
        return Path(override).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME")
    base = Path(cache).expanduser() if cache else Path.home() / ".cache"
    return base / "tree-attn" / "profiles"


def profile_path_for(fingerprint: str, directory: str | os.PathLike | None = None) -> Path:
    """The saved-profile path of a machine: ``<profile dir>/<fingerprint>.yaml``."""
    if (not isinstance(fingerprint, str) or not fingerprint or any(c in fingerprint for c in "/\\")
            or fingerprint.startswith(".")):
        raise ProfileError("fingerprint: expected a topology fingerprint such as '55d1318551c859a4', "
                           f"got {fingerprint!r}")
    base = Path(directory) if directory is not None else default_profile_dir()
    return base / f"{fingerprint}{PROFILE_SUFFIX}"


def find_saved_profile(fingerprint: str, directory: str | os.PathLike | None = None) -> Path | None:
    """The saved profile of the machine with this fingerprint, or None if there is none."""
    path = profile_path_for(fingerprint, directory)
    return path if path.is_file() else None


@dataclass
class ProfileEntry:
    """One profile found on disk or in the package: ``profile`` when it loads, else ``error``."""

    name: str
    path: str
    kind: str  # "builtin" or "saved"
    profile: Profile | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        p = self.profile
        return {
            "name": self.name,
            "kind": self.kind,
            "path": self.path,
            "origin": p.origin if p else None,
            "device_kind": p.machine.device_kind if p else None,
            "device_name": p.machine.device_name if p else None,
            "world_size": p.machine.world_size if p else None,
            "fingerprint": p.machine.fingerprint if p else None,
            "plan": p.reduction.plan.label if p else None,
            "plan_chosen_by": p.reduction.chosen_by if p else None,
            "created": p.created if p else None,
            "error": self.error,
        }


def list_saved_profiles(directory: str | os.PathLike | None = None) -> list[ProfileEntry]:
    """Every ``*.yaml`` in the profile folder, sorted by file name. A file that does not load is
    listed with its error instead of stopping the listing."""
    base = Path(directory) if directory is not None else default_profile_dir()
    if not base.is_dir():
        return []
    out: list[ProfileEntry] = []
    for path in sorted(base.glob(f"*{PROFILE_SUFFIX}")):
        if path.name.startswith("."):
            continue  # a temporary file of a save in progress
        try:
            prof = load_profile(path)
            out.append(ProfileEntry(name=prof.name, path=str(path), kind="saved", profile=prof))
        except ProfileError as exc:
            out.append(ProfileEntry(name=path.stem, path=str(path), kind="saved", error=str(exc)))
    return out
