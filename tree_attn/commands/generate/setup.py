"""Resolve ``tree-attn generate``'s options against this machine into a :class:`GenerateSpec`.

Everything is checked before a weight is read or a rank is spawned: the model folder, the prompt,
``--max-len``, the page size, the world size and the memory all ranks will need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError
from .models import ModelSource, check_source, load_tokenizer, require_transformers

MAX_NEW_TOKENS = 4096
PROCESS_BYTES = 400 * 2**20  # interpreter, torch and transformers per process


@dataclass(frozen=True)
class GenerateOptions:
    """What the user asked ``generate`` for; None / "auto" mean "decide from the machine"."""

    model: str | None = None
    preset: str = "small"
    layers: int | None = None
    seed: int = 0
    prompt: str | None = None
    prompt_len: int = 512
    new_tokens: int = 32
    max_len: int | None = None
    world_size: int | None = None
    strategy: str = "auto"
    fanout: int | None = None
    device: str = "auto"
    backend: str = "auto"
    dtype: str = "auto"  # see default_dtype
    page_size: int = 16
    timeout_s: float = 120.0
    profile: str | None = None


@dataclass(frozen=True)
class GenerateSetup:
    spec: Any  # GenerateSpec
    profile: Any  # commands.run.setup.ProfileChoice
    tokenizer: Any = None
    prompt_text: str | None = None
    notices: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    env: Any = None  # launch.spawn.RankEnv under torchrun (this process is one rank), else None

    @property
    def rank(self) -> int:
        return self.env.rank if self.env is not None else 0


def default_dtype(device_kind: str) -> str:
    """``generate``'s weights and KV dtype when ``--dtype auto``: bfloat16 on GPUs (what
    checkpoints ship in: half the bytes of float32, and the 16-bit paged kernel build, where
    float32's spills registers), float32 on CPU ranks (16-bit matrix products are slow on most
    CPUs, and float32 keeps the rows' tokens equal to the reference's)."""
    return "bfloat16" if device_kind == "cuda" else "float32"


def parse_prompt(text: str | None, prompt_len: int, vocab: int, seed: int, tokenizer) -> tuple[list[int], str | None]:
    """``(token ids, prompt text or None)``. ``text`` is comma-separated ids (``"1,2,3"``) or, with
    a tokenizer, text; no text: ``prompt_len`` random ids from ``seed``."""
    import torch

    if text is None:
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1:
            raise ConfigError(f"--prompt-len must be an integer >= 1; got {prompt_len!r}")
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(), None
    parts = [p.strip() for p in text.split(",")]
    if parts and all(p.lstrip("-").isdigit() for p in parts):
        ids = [int(p) for p in parts]
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ConfigError(f"--prompt: token id {bad[0]} is outside the vocabulary 0..{vocab - 1}")
        return ids, None
    if tokenizer is None:
        raise ConfigError("--prompt: this model has no tokenizer, so the prompt must be comma-separated token ids "
                          "(for example --prompt 1,2,3)")
    ids = tokenizer.encode(text)
    if not ids:
        raise ConfigError("--prompt: the text encodes to no tokens")
    return list(ids), text


def _check_window(config: dict, total: int) -> None:
    """Refuse a sliding-window model whose window the context would exceed (tree-attn attends to
    the whole cache: past the window the result would differ from the model's)."""
    window = config.get("sliding_window")
    if config.get("model_type") == "qwen2" and not config.get("use_sliding_window", False):
        window = None
    if window is not None and total > int(window):
        raise ConfigError(f"this model attends over a sliding window of {window} tokens and the context would reach "
                          f"{total}; tree-attn generate attends over the whole cache: keep prompt + --new-tokens <= {window}")


def _param_bytes(config: dict, elem: int) -> int:
    """Bytes of the model's weights, from its config (a Llama-family decoder)."""
    h, inter, layers, vocab = (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"],
                               config["vocab_size"])
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    d = config.get("head_dim") or h // heads
    per_layer = h * d * (2 * heads + 2 * kv) + 3 * h * inter + 2 * h
    embeds = vocab * h * (1 if config.get("tie_word_embeddings") else 2)
    return elem * (layers * per_layer + embeds + h)


def plan_generate(options: GenerateOptions) -> GenerateSetup:
    """Check ``options`` and resolve them; raises ConfigError / ProfileError naming the option."""
    from ...dtypes import parse_dtype, torch_dtype
    from ...kernels.paged import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE
    from ...launch.spawn import (
        check_cpu_ranks, check_timeout, oversubscription_warning, resolve_backend, torchrun_env, torchrun_layout,
        torchrun_rendezvous,
    )
    from ...topology.host import default_cpu_ranks
    from .decode import GenerateSpec, ModelShape
    from ...launch.memory import available_host_bytes
    from ..run.setup import choose_plans, kernel_config_for, parse_strategies, resolve_device_kind

    check_timeout(options.timeout_s)
    if isinstance(options.seed, bool) or not isinstance(options.seed, int) or not 0 <= options.seed < 2**40:
        raise ConfigError(f"--seed must be an integer in 0..2**40; got {options.seed!r}")
    require_transformers()
    source = ModelSource(path=options.model, preset=options.preset, layers=options.layers, seed=options.seed)
    config = check_source(source)
    shape = ModelShape.from_config(config)
    page = options.page_size
    if isinstance(page, bool) or not isinstance(page, int) or not MIN_BLOCK_SIZE <= page <= MAX_BLOCK_SIZE:
        raise ConfigError(f"--page-size must be an integer in {MIN_BLOCK_SIZE}..{MAX_BLOCK_SIZE} (the block sizes the "
                          f"decode kernels take); got {page!r}")
    n_new = options.new_tokens
    if isinstance(n_new, bool) or not isinstance(n_new, int) or not 1 <= n_new <= MAX_NEW_TOKENS:
        raise ConfigError(f"--new-tokens must be an integer in 1..{MAX_NEW_TOKENS}; got {n_new!r}")
    max_len = shape.max_positions if options.max_len is None else options.max_len
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
        raise ConfigError(f"--max-len must be an integer >= 2; got {max_len!r}")
    if options.prompt is None and options.prompt_len > max_len:  # before making the random prompt
        raise ConfigError(f"--prompt-len {options.prompt_len:,} is longer than --max-len {max_len:,}")
    tokenizer = load_tokenizer(source)
    ids, text = parse_prompt(options.prompt, options.prompt_len, shape.vocab, options.seed, tokenizer)
    if len(ids) > max_len:
        raise ConfigError(f"the prompt has {len(ids):,} tokens, longer than --max-len {max_len:,}")
    if len(ids) + n_new > max_len:
        raise ConfigError(f"the prompt ({len(ids):,} tokens) plus --new-tokens {n_new} is {len(ids) + n_new:,} tokens, "
                          f"more than --max-len {max_len:,}")
    _check_window(config, len(ids) + n_new)

    device_kind, n_gpus = resolve_device_kind(options.device)
    trun = torchrun_env(device_kind, options.backend)
    if trun is not None:
        torchrun_rendezvous(trun)  # MASTER_ADDR / MASTER_PORT named if missing, before any work
        if options.world_size is not None and options.world_size != trun.world_size:
            raise ConfigError(f"torchrun started {trun.world_size} ranks but --world-size is {options.world_size}; "
                              "omit --world-size under torchrun")
    world = options.world_size
    if world is None:
        world = trun.world_size if trun else (n_gpus if device_kind == "cuda" else default_cpu_ranks())
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ConfigError(f"--world-size must be an integer >= 1; got {world!r}")
    if device_kind == "cuda" and trun is None and world > n_gpus:
        raise ConfigError(f"world size {world} is larger than the {n_gpus} GPUs of this machine")
    if device_kind == "cpu" and trun is None:
        check_cpu_ranks(world)
    dtype = parse_dtype(default_dtype(device_kind) if options.dtype == "auto" else options.dtype)
    backend = resolve_backend(options.backend, device_kind)
    notices: list[str] = []
    warnings: list[str] = []
    if device_kind == "cpu" and trun is None:
        why = "no GPU in use" if options.device == "auto" else "--device cpu"
        notices.append(f"{why}: spawning {world} CPU rank{'s' if world != 1 else ''} (gloo)")
        crowded = oversubscription_warning(world)
        if crowded:
            warnings.append(crowded)
        elem = torch_dtype(dtype).itemsize
        weights = _param_bytes(config, elem)
        total = len(ids) + n_new
        # The launching process holds no weights: the one-process child (which has exited before
        # the ranks start) holds a copy, then each rank does.
        need = world * (weights + PROCESS_BYTES) + PROCESS_BYTES + 3 * shape.kv_bytes(total, dtype)
        have = available_host_bytes()
        if have is not None and need > have:
            raise ConfigError(
                f"this generate needs about {need / 2**30:,.1f} GiB of host memory (a copy of the model's "
                f"{weights / 2**30:,.1f} GiB of weights in each of {world} ranks, and the KV cache of "
                f"{total:,} tokens); {have / 2**30:,.1f} GiB are available: use fewer ranks, layers or tokens"
            )
    if dtype != "float32":
        warnings.append(f"{dtype}: rounding may differ between the reference and the ranks, and greedy tokens with it")
    if source.random_weights:
        notices.append(f"model: {source.label}; random weights, so the output is token ids, not text")
    names = parse_strategies(options.strategy)
    layout = torchrun_layout(trun) if trun is not None else None
    profile, choice, profile_warnings, plans = choose_plans(options.profile, names, options.fanout, world, device_kind,
                                                            layout)
    spec = GenerateSpec(
        source=source, prompt_ids=tuple(ids), new_tokens=n_new, world_size=world, strategies=plans,
        device_kind=device_kind, backend=backend, dtype=dtype, page_size=options.page_size,
        timeout_s=options.timeout_s, seed=options.seed,
        kernel_config=kernel_config_for(profile, dtype, shape.q_heads, shape.kv_heads, shape.head_dim,
                                        len(ids) + n_new, world),
    )
    return GenerateSetup(spec=spec, profile=choice, tokenizer=tokenizer, prompt_text=text, notices=tuple(notices),
                         warnings=tuple(warnings + list(profile_warnings)), env=trun)
