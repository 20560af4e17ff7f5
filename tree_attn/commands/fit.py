"""``tree-attn fit``: the longest context a box can hold for a model, without the box.

The same arithmetic ``generate`` checks before anything loads (:mod:`tree_attn.cost.capacity`,
:mod:`tree_attn.commands.generate.memory`): per rank the whole model's weights, its zig-zag share
of the prompt's KV (the last rank also the new tokens'), the prefill's activations and the process's
overhead, against each GPU's memory (its catalogued size, or ``--memory``) or, on CPU ranks, one
host's memory shared by its ranks. The answer is a bisection over the prompt length (a longer
prompt never needs less), for the world size asked and for 2x and 4x as many ranks. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cost.capacity import GiB, ModelDims, RankMemory, largest_prompt
from ..cost.devices import KNOWN_DEVICES
from ..dtypes import is_fp8, parse_dtype, parse_kv_dtype
from ..errors import ConfigError
from ..sizes import parse_count
from .defaults import MAX_SEQ
from .generate.models import hub_hint, read_config_json, resolve_model_path

# Real configs (every layer, the real vocabulary: unlike generate's random-weight presets, which
# keep two layers and a 32,000-token vocabulary so that a CPU can run them). Values from the
# models' config.json on the Hugging Face hub.
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        tie_word_embeddings=False, max_position_embeddings=131072,
    ),
    "llama-3.1-70b": dict(
        model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        tie_word_embeddings=False, max_position_embeddings=131072,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, head_dim=128, vocab_size=152064,
        tie_word_embeddings=False, max_position_embeddings=131072,
    ),
}
DEVICE_KINDS = ("cuda", "cpu")
MAX_MEMORY = 2**50  # 1 PiB: far beyond any one GPU or host
FACTORS = (1, 2, 4)  # the world size asked, and with 2x and 4x the ranks


def parse_memory(text: str | int) -> int:
    """``24GiB``, ``80GB``, ``512MiB`` or a byte count -> bytes; ConfigError otherwise."""
    units = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
             "gb": 10**9, "tb": 10**12}
    raw = str(text).strip().lower().replace(" ", "").replace(",", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or not value > 0:
        raise ConfigError(f"--memory {text!r}: expected a size such as 24GiB, 80GB or 512MiB")
    if value * units[unit] > MAX_MEMORY:  # 1e30GiB is a typo, and its table would be unreadable
        raise ConfigError(f"--memory {text!r}: more than 1,024 TiB; give one GPU's memory (or the host's), "
                          "such as 80GB")
    return int(value * units[unit])


@dataclass(frozen=True)
class FitOptions:
    """What ``tree-attn fit`` is asked: a model (``preset`` or a ``config`` path), the machine
    (``gpu`` name from the device catalogue or ``memory`` per GPU / per host, ``gpus`` ranks), dtypes."""

    preset: str | None = None
    config: str | None = None
    gpu: str | None = None
    memory: str | None = None
    gpus: int = 1  # ranks: GPUs, or CPU ranks on the host
    device: str = "cuda"
    dtype: str = "bf16"
    kv_dtype: str | None = None  # default: --dtype
    new_tokens: int = 32


@dataclass
class FitRow:
    """The largest prompt on ``ranks`` ranks, and the busiest rank's memory at that prompt."""

    ranks: int
    tokens: int
    rank: RankMemory | None
    capped: bool = False  # the model's max positions, not memory, is the limit

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": self.ranks, "largest_prompt": self.tokens, "capped_by_max_positions": self.capped,
                "busiest_rank": self.rank.to_dict() if self.rank is not None else None}


@dataclass
class FitResult:
    model: str
    dims: ModelDims
    device: str  # "NVIDIA GeForce RTX 4090" or "CPU host"
    device_kind: str
    memory_bytes: int
    memory_source: str
    dtype: str
    kv_dtype: str
    new_tokens: int
    rows: list[FitRow]
    one_process: int  # the reference (transformers alone) on one device / host
    max_positions: int | None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = self.dims
        return {
            "model": self.model, "layers": d.layers, "params": d.params(), "device": self.device,
            "device_kind": self.device_kind, "memory_bytes": self.memory_bytes, "memory_source": self.memory_source,
            "dtype": self.dtype, "kv_dtype": self.kv_dtype, "new_tokens": self.new_tokens,
            "kv_bytes_per_token": d.kv_bytes_per_token(self.kv_dtype), "max_positions": self.max_positions,
            "rows": [r.to_dict() for r in self.rows], "reference_largest_prompt": self.one_process,
            "notes": self.notes,
        }


def _model(options: FitOptions) -> tuple[str, dict[str, Any]]:
    if (options.preset is None) == (options.config is None):
        raise ConfigError(f"give one of --preset ({', '.join(MODEL_CONFIGS)}) or --config PATH (a config.json or "
                          "a checkpoint folder)")
    if options.preset is not None:
        if options.preset not in MODEL_CONFIGS:
            raise ConfigError(f"unknown --preset {options.preset!r}; choose from {', '.join(MODEL_CONFIGS)} or give "
                              "--config PATH")
        return options.preset, MODEL_CONFIGS[options.preset]
    path = Path(resolve_model_path(options.config))
    if path.is_dir():
        path = path / "config.json"
    config = read_config_json(path, unreadable=f"--config {options.config}: not a readable config.json"
                              f"{hub_hint(options.config) if path == Path(options.config) else ''}",
                              not_object=f"--config {options.config}: expected a JSON object (a model's config.json)")
    return str(options.config), config


def catalogue_key(name: str) -> str:
    """The device catalogue's key for ``name``: the key itself, case, spaces, '-' and '_' aside
    ('RTX 4090', 'rtx-4090', 'H100_SXM'). Anything else is a ConfigError that lists the keys, with
    the ones ``name`` is part of first ('h100': h100-nvl, h100-pcie, h100-sxm); it never guesses
    between them, since their memory sizes differ."""
    squash = "".join(ch for ch in name.lower() if ch not in " \t-_")
    keys = sorted(KNOWN_DEVICES)
    same = [k for k in keys if k.replace("-", "") == squash]
    if len(same) == 1:
        return same[0]
    near = [k for k in keys if squash and squash in k.replace("-", "")]
    hint = f"did you mean {', '.join(near)}? " if near else ""
    raise ConfigError(f"unknown --gpu {name!r}; {hint}the catalogue has {', '.join(keys)} "
                      "(or give --memory SIZE per GPU)")


def _machine(options: FitOptions) -> tuple[str, int, str]:
    """(device name, bytes per GPU or per host, where that figure comes from)."""
    if options.device not in DEVICE_KINDS:
        raise ConfigError(f"--device must be cuda or cpu; got {options.device!r}")
    if options.device == "cpu":
        if options.gpu is not None:
            raise ConfigError("--gpu names a GPU; with --device cpu give the host's memory as --memory")
        if options.memory is None:
            raise ConfigError("--device cpu needs --memory (the host's memory, which its CPU ranks share)")
        return "CPU host", parse_memory(options.memory), "--memory"
    if options.gpu is None:
        if options.memory is None:
            raise ConfigError(f"give --gpu NAME ({', '.join(sorted(KNOWN_DEVICES))}) or --memory SIZE per GPU")
        return "GPU", parse_memory(options.memory), "--memory"
    key = catalogue_key(options.gpu)
    spec = KNOWN_DEVICES[key]
    if options.memory is not None:
        return spec.name, parse_memory(options.memory), "--memory"
    if spec.memory_bytes is None:
        raise ConfigError(f"the device catalogue has no memory size for {key}; give --memory SIZE per GPU")
    return spec.name, spec.memory_bytes, "device catalogue (what the driver reports)"


def fit(options: FitOptions) -> FitResult:
    """Answer ``options`` (see the module); ConfigError naming the bad option."""
    from .generate.memory import GenerateEstimate, JobShape, estimate_generate
    from .generate.setup import GenerateOptions

    name, config = _model(options)
    dims = ModelDims.from_config(config)
    device, memory, source = _machine(options)
    ranks = options.gpus
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= 4096:
        raise ConfigError(f"--gpus/-g must be an integer in 1..4096; got {ranks!r}")
    if is_fp8(options.dtype):  # named before parse_dtype's general refusal: fit's option for it is --kv-dtype
        raise ConfigError(f"--dtype {options.dtype}: fp8 is a KV-cache dtype (--kv-dtype); weights are bf16, fp16 "
                          "or fp32")
    dtype = parse_dtype(options.dtype)
    kv_dtype = parse_kv_dtype(options.kv_dtype or options.dtype)
    new = parse_count(options.new_tokens)
    if not 1 <= new <= MAX_SEQ:
        raise ConfigError(f"--new-tokens must be in 1..{MAX_SEQ:,}; got {new}")
    # generate's defaults: its page size, and its strategies (ring among them, whose decode gathers a layer shard)
    shape = JobShape(dims, new, dtype, kv_dtype, options.device, GenerateOptions().page_size, preset=False,
                     ring_decode=True)
    cpu = options.device == "cpu"
    limit = MAX_SEQ - new

    def estimate(world: int, tokens: int) -> GenerateEstimate:
        return GenerateEstimate(shape.ranks(tokens, world), shape.ranks(1, 1)[0], shape.ranks(1, 1)[0],
                                _budget(options.device, memory), world if cpu else 1, spawned=True)

    def fits_on(world: int):
        return lambda tokens: estimate(world, tokens).job_bytes() <= memory

    rows = []
    for factor in FACTORS:
        world = factor * ranks
        tokens = largest_prompt(fits_on(world), limit)
        busiest = max(shape.ranks(tokens, world), key=lambda r: r.total) if tokens else None
        capped = dims.max_positions is not None and tokens + new > dims.max_positions
        rows.append(FitRow(world, tokens, busiest, capped))

    def reference_fits(tokens: int) -> bool:
        est = estimate_generate(shape, tokens, 1, _budget(options.device, memory), 1, spawned=True)
        return est.one_process_bytes(est.reference) <= memory

    notes = []
    if any(r.capped for r in rows):
        notes.append(f"the model attends over at most {dims.max_positions:,} positions (max_position_embeddings): "
                     "a longer prompt fits in memory but not in the model")
    empty = [r.ranks for r in rows if not r.tokens]
    if empty:  # say why "none": the weights, which every rank holds whole, whatever the prompt
        least = estimate(empty[0], 1)
        weights = max(r.weights for r in least.ranks) / GiB
        notes.append(
            f"none: with a 1-token prompt each rank needs {least.job_bytes() / GiB:,.1f} GiB, more than a GPU's "
            f"{memory / GiB:,.1f} GiB; every rank holds the whole model ({weights:,.1f} GiB of weights), so more GPUs "
            "do not help" if not cpu else
            f"none on {empty[0]} ranks: with a 1-token prompt they need {least.job_bytes() / GiB:,.1f} GiB together, "
            f"more than the host's {memory / GiB:,.1f} GiB (each rank holds the whole model, {weights:,.1f} GiB of "
            "weights)")
    if cpu:
        notes.append(f"CPU ranks share one host's {memory / GiB:,.1f} GiB: each rank holds a copy of the weights, so "
                     "more ranks on the same host hold less")
    return FitResult(model=name, dims=dims, device=device, device_kind=options.device, memory_bytes=memory,
                     memory_source=source, dtype=dtype, kv_dtype=kv_dtype, new_tokens=new, rows=rows,
                     one_process=largest_prompt(reference_fits, limit), max_positions=dims.max_positions, notes=notes)


def _budget(kind: str, memory: int):
    from .generate.memory import Budget

    return Budget(kind, per_device=memory, source="given") if kind == "cuda" else Budget(kind, shared=memory,
                                                                                       source="given")


__all__ = ["MODEL_CONFIGS", "FitOptions", "FitResult", "FitRow", "catalogue_key", "fit", "parse_memory"]
