"""Reading and writing the files tree-attn owns: YAML read safely, text written atomically.

One helper each, used by every reader and writer (topologies, dumps, profiles, JUnit reports):

- :func:`load_yaml`: ``yaml.safe_load`` that refuses anchors and aliases (``&a``, ``*a``). None of
  our files needs them, and an alias "bomb" (a few lines whose aliases expand to billions of
  nodes) would otherwise cost minutes and gigabytes before any field is checked. It raises
  :class:`YAMLAliasError`, a ``yaml.YAMLError`` with the line and column, at the first anchor.
- :func:`atomic_write_text` / :func:`atomic_write_bytes`: a temporary file in the target folder,
  fsynced, then renamed over the target (or hard-linked, when an existing file must not be
  replaced), so a crash or a full disk never leaves half a file. A symbolic link is written through
  (its target replaced), and a target that is not a regular file is refused. ``mkstemp`` creates the
  file with mode 0600; it is given the mode a plain ``open()`` would (0666 less the umask) before
  the rename, so that a CI uploader running as another user can read a JUnit report written under
  umask 022.
- :func:`unwritable`: why a path could not be written, asked before long work by every option
  that writes a file (missing folders are created; the file system is asked by creating and
  removing an empty file, since permission bits say yes to root everywhere).
  :func:`cannot_write` puts its answer in the one line every such refusal reads, and
  :func:`exit_if_unwritable` refuses it for a script that parses its own arguments (benchmarks/).

Callers turn ``OSError`` and ``yaml.YAMLError`` into their own :class:`TreeAttnError` subclasses.
Imports nothing of the project.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from typing import IO, Any

import yaml
from yaml.composer import ComposerError


class YAMLAliasError(ComposerError):
    """A YAML anchor or alias where tree-attn reads plain data."""


class _NoAliasLoader(yaml.SafeLoader):
    """``SafeLoader`` that stops at the first anchor or alias, before anything is expanded."""

    def compose_node(self, parent, index):  # PyYAML's hook
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            kind = "alias *" if isinstance(event, yaml.AliasEvent) else "anchor &"
            raise YAMLAliasError(
                None, None,
                f"YAML {kind}{event.anchor} is not accepted: tree-attn files hold plain values, write them out",
                event.start_mark,
            )
        return super().compose_node(parent, index)


def load_yaml(stream: str | bytes | IO[str]) -> Any:
    """``yaml.safe_load(stream)`` without anchors or aliases (:class:`YAMLAliasError`)."""
    loader = _NoAliasLoader(stream)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def yaml_problem(exc: yaml.YAMLError) -> str:
    """One line for a YAML error: ``line L, column C: what`` (PyYAML's own text spans lines)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or (str(exc).splitlines() or ["not valid YAML"])[0]
    context = getattr(exc, "context", None)
    what = f"{context}, {problem}" if context and not isinstance(exc, YAMLAliasError) else problem
    return f"line {mark.line + 1}, column {mark.column + 1}: {what}" if mark is not None else what


def _umask() -> int:
    # os.umask can only be read by setting it; set it straight back.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# The name of the empty file (or folder) unwritable creates and removes at once.
_PROBE_PREFIX = ".tree-attn-write-check."


def unwritable(path: str | os.PathLike) -> str | None:
    """Why :func:`atomic_write_bytes` could not write ``path``, or None: said before long work
    (a tune, a measurement, a sweep), not after. Every option that writes a file asks this first.

    The rule for every such option: missing folders are created (as ``atomic_write_bytes`` does),
    so the nearest existing folder above ``path`` decides: a file where a folder should be, or a
    folder this user cannot write in. ``path`` itself must not be a folder or anything but a
    regular file (a symbolic link is followed, as the write follows it). The reason reads after
    ``"cannot write PATH: "``.

    Whether the folder can be written is asked of the file system itself: an empty file is
    created there and removed (a folder, when folders are still to be made). Permission bits
    (``os.access``) answer yes to root everywhere, also where the write then fails (``/proc``, a
    read-only bind mount, a file system that refuses new files), and the command would fail only
    after its long work."""
    path = os.fspath(path)
    if os.path.lexists(path):
        real = os.path.realpath(path)
        if os.path.isdir(real):
            return "it is a folder, not a file"
        if os.path.exists(real) and not stat.S_ISREG(os.stat(real).st_mode):
            return "it is not a regular file (only files are written)"
        path = real
    parent = folder = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return f"{folder} is a file, not a folder"
    try:
        if folder == parent:  # the temporary file of the write is made here
            fd, probe = tempfile.mkstemp(prefix=_PROBE_PREFIX, dir=folder)
            os.close(fd)
            os.unlink(probe)
        else:  # the missing folders are made here
            os.rmdir(tempfile.mkdtemp(prefix=_PROBE_PREFIX, dir=folder))
    except OSError as exc:
        return f"the folder {folder} cannot be written (a test file could not be created: {exc.strerror or exc})"
    return None


def cannot_write(path: str | os.PathLike, option: str) -> str | None:
    """``cannot write OPTION PATH: <why>`` where :func:`unwritable` refuses ``path``, else None: the
    one line of every refusal, the CLI's (``cli.common.check_output``) and the scripts'."""
    problem = unwritable(path)
    return f"cannot write {option} {os.fspath(path)}: {problem}" if problem else None


def exit_if_unwritable(parser: Any, outputs: dict[str, str | os.PathLike | None]) -> None:
    """Before any work, in a script that parses its own arguments (the benchmarks): every output
    option given, ``{"--out": args.out, "--plot": args.plot}`` (None: not asked for, skipped), by
    the rule of :func:`unwritable`. The first that could not be written ends the script as argparse
    ends a usage error, without the usage: exit status 2 and one line on stderr,
    ``PROG: error: cannot write --out PATH: <why>``. ``parser`` is the script's
    ``argparse.ArgumentParser`` (its ``prog`` and ``exit``). Nothing is created."""
    for option, path in outputs.items():
        line = cannot_write(path, option) if path is not None else None
        if line:
            parser.exit(2, f"{parser.prog}: error: {line}\n")


def atomic_write_text(path: str | os.PathLike, text: str, *, replace: bool = True) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`atomic_write_bytes`)."""
    atomic_write_bytes(path, text.encode("utf-8"), replace=replace)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, replace: bool = True) -> None:
    """Write ``data`` to ``path`` atomically, with the mode ``open()`` would give it.

    The folder is created if needed. With ``replace=False`` an existing ``path`` is never
    touched: ``FileExistsError`` (also when the file appears while writing: the final step is a
    hard link, which fails on an existing name; file systems without hard links fall back to a
    checked rename). Replacing writes through a symbolic link (its target is replaced, the link
    stays), and refuses a target that is not a regular file (a folder, a device such as
    ``/dev/null``, a FIFO): ``IsADirectoryError`` or ``OSError(EINVAL)``. Raises ``OSError`` on any
    failure; the temporary file is removed.
    """
    path = os.fspath(path)
    if replace and os.path.lexists(path):
        path = os.path.realpath(path)
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
            raise OSError(errno.EINVAL, "not a regular file (only files are written)", path)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except FileExistsError:  # a file where the folder should be: not "the target exists"
        raise NotADirectoryError(20, "Not a directory", folder) from None
    if not replace and os.path.lexists(path):
        raise FileExistsError(17, "File exists", path)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.chmod(tmp, 0o666 & ~_umask())
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise
            except OSError:
                if os.path.lexists(path):
                    raise FileExistsError(17, "File exists", path) from None
                os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
