"""The language models ``tree-attn generate`` decodes: a local Hugging Face checkpoint of the Llama
family, or a model built from a preset config with a fixed seed (random weights).

Model code is Hugging Face ``transformers``' own (the ``[models]`` extra); tree-attn only routes
attention through its hook (see :mod:`.hf_attention`). Nothing here touches the network:
checkpoints load with ``local_files_only``, and a hub id names a snapshot already in the local
Hugging Face cache (:func:`resolve_model_path`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ...validate import check_int
from ..defaults import SEED

# Architectures whose attention is plain multi-head/grouped-query softmax attention with RoPE,
# computed by the model as q, k, v then the attention interface: what tree-attn decodes exactly.
SUPPORTED_TYPES = ("llama", "qwen2", "mistral")

# Presets built from a config with random weights. ``small``: a small Llama with grouped-query
# attention (8 query heads over 2 KV heads) that decodes fast on CPU ranks. ``llama-3.1-8b``:
# Llama-3.1-8B's layer shapes (hidden 4096, 32 query heads, 8 KV heads, head dim 128, MLP
# 14336, RoPE theta 500000) with --layers of them (default 2) and a 32,000-token vocabulary
# instead of 128,256 so that four CPU ranks with a copy each fit in host memory; attention,
# the part tree-attn changes, has the 8B's shape.
PRESETS: dict[str, dict[str, Any]] = {
    "small": dict(
        hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, vocab_size=4096, rope_theta=500000.0,
        max_position_embeddings=262144, initializer_range=0.3,
    ),
    "llama-3.1-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=32000, rope_theta=500000.0,
        max_position_embeddings=262144, initializer_range=0.075,
    ),
}
# The initializer ranges are wider than a trained model's 0.02: with 0.02 and random weights the
# logits are nearly flat, greedy decoding repeats one token, and an exactness check would prove
# little. Wider weights give spread-out logits and varied tokens.
DEFAULT_PRESET = "small"
# The first transformers whose models take ``cache=`` (5.24 renamed ``past_key_values=``, which
# warns until its removal in 5.40). An older one would pass ``cache=`` through its ``**kwargs``
# unread: the reference would decode without its cache.
MIN_TRANSFORMERS = (5, 24)
MODELS_EXTRA = 'pip install "transformers>=5.24,<6" safetensors (in a checkout of tree-attn: pip install ".[models]")'


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a checkpoint folder (``path``) or a ``preset`` with ``seed``.

    ``layers`` overrides a preset's layer count (checkpoints keep theirs).
    """

    path: str | None = None
    preset: str = DEFAULT_PRESET
    layers: int | None = None
    seed: int = SEED
    name: str | None = None  # what the user named: a hub id that ``path`` (its cached snapshot) resolves

    @property
    def random_weights(self) -> bool:
        return self.path is None

    @property
    def label(self) -> str:
        if self.name is not None:
            return self.name
        if self.path is not None:
            return os.path.basename(os.path.normpath(self.path)) or self.path
        layers = f", {self.layers} layers" if self.layers is not None else ""
        return f"{self.preset} preset (random weights, seed {self.seed}{layers})"


def require_transformers() -> None:
    """Raise :class:`ConfigError` naming the extra when transformers is missing or older than
    :data:`MIN_TRANSFORMERS`."""
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(f"tree-attn generate needs Hugging Face transformers: {MODELS_EXTRA}") from exc
    if transformers_version(transformers.__version__) < MIN_TRANSFORMERS:
        need = ".".join(map(str, MIN_TRANSFORMERS))
        raise ConfigError(f"tree-attn generate needs transformers {need} or newer; found {transformers.__version__}: "
                          f"{MODELS_EXTRA}")


def transformers_version(text: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``5.24.0`` or ``5.25.0.dev0``."""
    import re

    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def read_config_json(path: Path, *, unreadable: str, not_object: str) -> dict[str, Any]:
    """The JSON object in a model's ``config.json`` at ``path``: ConfigError ``"{unreadable} ({why})"``
    when the file cannot be read or parsed, ``not_object`` when it holds something else than an object."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{unreadable} ({exc})") from exc
    if not isinstance(config, dict):
        raise ConfigError(not_object)
    return config


# A Hugging Face hub id: ``org/name`` (letters, digits, '.', '-', '_'), not a path of this machine.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def _hub_id(name: str) -> bool:
    """Whether ``name`` can only mean a hub id: shaped like one and no such path here."""
    return bool(_HUB_ID.fullmatch(name)) and not os.path.exists(name)


def resolve_model_path(name: str) -> str:
    """``--model``'s (or ``fit --config``'s) folder: ``name`` itself when it exists here; else, for a
    hub id (``org/name``) already in the local Hugging Face cache (``$HF_HUB_CACHE``, else
    ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), its cached snapshot of ``main``; else
    ``name`` unchanged (the checks that follow say what is missing). Nothing is downloaded."""
    if not _hub_id(name):
        return name
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # fit without the models extra: a path only
        return name
    try:
        return snapshot_download(name, local_files_only=True)
    except (LocalEntryNotFoundError, ValueError, OSError):  # not cached, or an id the hub refuses
        return name


def hub_hint(name: str) -> str:
    """For an error about ``name`` not being found: what to do when it is a hub id ("" otherwise)."""
    if not _hub_id(name):
        return ""
    return (f", nor a hub id in this machine's Hugging Face cache (nothing is downloaded: `hf download {name}` "
            "first)")


def check_source(source: ModelSource) -> dict[str, Any]:
    """Check ``source`` before any weight is read; return the model's config as a dict.

    A checkpoint folder must hold ``config.json`` of a supported architecture and safetensors
    weights; the error names what is missing. A preset must exist; ``layers`` must be >= 1.
    """
    if source.layers is not None:  # not optional=True: its message would add "or null"
        check_int(source.layers, "--layers", minimum=1, must=True)
    if source.path is None:
        if source.preset not in PRESETS:
            raise ConfigError(f"unknown model preset {source.preset!r}; choose from {', '.join(PRESETS)}")
        config = dict(PRESETS[source.preset], model_type="llama")
        if source.layers is not None:
            config["num_hidden_layers"] = source.layers
        return config
    if source.layers is not None:
        raise ConfigError("--layers applies to a preset, not to a checkpoint (a checkpoint keeps its layers)")
    folder = Path(source.path)
    if not folder.is_dir():
        raise ConfigError(f"--model {source.path}: no such folder "
                          f"(a checkpoint folder with config.json and *.safetensors){hub_hint(source.path)}")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"--model {source.path}: config.json is missing from the folder")
    config = read_config_json(config_file, unreadable=f"--model {source.path}: config.json is not readable JSON",
                              not_object=f"--model {source.path}: config.json must hold a JSON object")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        archs = config.get("architectures")
        raise ConfigError(
            f"--model {source.path}: architecture {model_type!r}{f' ({archs})' if archs else ''} is not supported; "
            f"tree-attn generate decodes {', '.join(SUPPORTED_TYPES)} checkpoints"
        )
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise ConfigError(
            f"--model {source.path}: no *.safetensors weights in the folder (other weight formats are not read)"
        )
    for f in weights:
        problem = safetensors_problem(f)
        if problem:
            raise ConfigError(f"--model {source.path}: {f.name} {problem}")
    return config


LFS_POINTER = b"version https://git-lfs"
MAX_HEADER = 100_000_000  # bytes: the largest header the safetensors library reads


def safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole safetensors file, or None. Reads its header only: an 8-byte
    little-endian length, that many bytes of JSON, then the tensors, whose last ``data_offsets``
    end must be the rest of the file (a truncated download, or a Git LFS pointer left by a clone
    made without ``git lfs``, fails here, before any rank starts)."""
    try:
        with open(path, "rb") as fh:
            start = fh.read(len(LFS_POINTER))
            size = os.fstat(fh.fileno()).st_size
            if start.startswith(LFS_POINTER):
                return "is a Git LFS pointer, not the weights: fetch them with `git lfs pull` in the checkpoint's clone"
            head = start[:8]
            fh.seek(8)
            if len(head) < 8:
                return f"is not a safetensors file ({size} bytes)"
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER:  # safetensors' own limit: no multi-GB read of a corrupt length
                return f"is not a safetensors file (its header claims {n:,} bytes, more than the format allows)"
            if n < 2 or 8 + n > size:
                return f"is not a whole safetensors file (its header claims {n:,} bytes, the file has {size:,}): " \
                       "a truncated download?"
            header = json.loads(fh.read(n).decode("utf-8"))
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    except (UnicodeDecodeError, json.JSONDecodeError):
        return "is not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return "is not a safetensors file (its header is not a JSON object)"
    offsets = [t.get("data_offsets") for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    if not all(isinstance(o, list) and len(o) == 2 and all(isinstance(x, int) for x in o) for o in offsets):
        return "is not a safetensors file (bad data_offsets)"
    ends = [o[1] for o in offsets]
    data = size - 8 - n
    if ends and max(ends) != data:
        return f"is cut short or padded: its tensors end at byte {max(ends):,} of the data, the file has {data:,} " \
               "(a truncated download?)"
    return None


def build_model(source: ModelSource, *, dtype, device) -> Any:
    """The model of ``source`` in eval mode on ``device`` with ``dtype`` weights, attention
    ``sdpa`` (the reference); :func:`.hf_attention.use_tree_attention` switches it."""
    import torch

    require_transformers()
    config = check_source(source)
    if source.path is None:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"}, attn_implementation="sdpa")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(source.seed)
            model = LlamaForCausalLM(cfg)  # weights from the config's initializer, seeded
        model = model.to(dtype=dtype)
    else:
        from transformers import AutoModelForCausalLM

        try:
            with _no_progress_bars():
                model = AutoModelForCausalLM.from_pretrained(
                    source.path, local_files_only=True, dtype=dtype, attn_implementation="sdpa"
                )
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"--model {source.path}: the checkpoint did not load: {exc}") from exc
    return model.to(device).eval()


@contextlib.contextmanager
def _no_progress_bars():
    """transformers' progress bars off inside the block (as they were after it). Each rank and the
    reference's child load the checkpoint: their "Loading weights" bars would interleave on
    stderr beside the ranks' own "loading" lines, and the first bar of a process creates tqdm's
    multiprocessing lock, which a spawned process never frees: Python's resource tracker then
    ends the command with a warning of one "leaked semaphore" per process."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def load_tokenizer(source: ModelSource) -> Any | None:
    """The checkpoint's tokenizer, or None (a preset, or a folder without tokenizer files)."""
    if source.path is None:
        return None
    folder = Path(source.path)
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source.path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model {source.path}: the tokenizer did not load: {exc}") from exc
