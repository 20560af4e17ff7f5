"""Resolve ``tree-attn generate``'s options against this machine into a :class:`GenerateSpec`.

Everything is checked before a weight is read or a rank is spawned: the model folder, the prompt,
``--max-len``, the page size, the world size, and whether the job fits in this machine's free
memory (:mod:`.memory`: a prompt that cannot fit is refused, naming the largest that would), and
which one-process rows run (``--reference``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...dtypes import is_fp8
from ...errors import ConfigError
from ...launch.setup import AnnouncesLaunch, PlanOptions
from ...validate import check_int, is_int
from ..defaults import SEED
from .models import DEFAULT_PRESET, ModelSource, check_source, load_tokenizer, require_transformers, resolve_model_path
from .ties import TIE_ULPS_PER_ROOT_LAYER

if TYPE_CHECKING:  # pragma: no cover
    from ...launch.env import RankEnv
    from .decode import GenerateSpec

MAX_NEW_TOKENS = 4096
PAGE_SIZE = 16  # tokens per KV page: vLLM's default block size

__all__ = ["GenerateOptions", "GenerateSetup", "parse_prompt", "plan_generate"]


@dataclass(frozen=True)
class GenerateOptions(PlanOptions):
    """What the user asked ``generate`` for: the launch and its plans (:class:`PlanOptions`; the
    dtype is the weights' and the KV cache's), the model, the prompt. These are the defaults of
    ``tree-attn generate`` and of :class:`~.decode.GenerateSpec`. ``kv_dtype``: the KV pools'
    (None: the dtype's; fp8 = float8_e4m3fn, quantized as written with per-layer, per-KV-head
    scales the ranks take together from the whole prompt at prefill)."""

    model: str | None = None
    preset: str = DEFAULT_PRESET
    layers: int | None = None
    seed: int = SEED
    prompt: str | None = None
    prompt_len: int = 512
    new_tokens: int = 32
    max_len: int | None = None
    page_size: int = PAGE_SIZE
    cuda_graph: bool = True
    reference: str = "auto"
    kv_dtype: str | None = None


@dataclass(frozen=True)
class GenerateSetup(AnnouncesLaunch):
    """A resolved generate: the spec (its launch holds the profile, notices and warnings of the
    launch), the tokenizer, the prompt's text, and what the command itself tells the user."""

    spec: GenerateSpec
    tokenizer: Any = None
    prompt_text: str | None = None
    own_notices: tuple[str, ...] = ()
    own_warnings: tuple[str, ...] = ()

    @property
    def env(self) -> RankEnv | None:
        """This process's place in a torchrun job (it is one rank), else None."""
        return self.spec.launch.torchrun


def parse_prompt(text: str | None, prompt_len: int, vocab: int, seed: int, tokenizer) -> tuple[list[int], str | None]:
    """``(token ids, prompt text or None)``. ``text`` is comma-separated ids (``"1,2,3"``) or, with
    a tokenizer, text; no text: ``prompt_len`` random ids from ``seed``."""
    import torch

    if text is None:
        check_int(prompt_len, "--prompt-len", minimum=1, must=True)
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
                          f"{total}; tree-attn generate attends over the whole cache: "
                          f"keep prompt + --new-tokens <= {window}")


def plan_generate(options: GenerateOptions) -> GenerateSetup:
    """Check ``options`` and resolve them; raises ConfigError / ProfileError naming the option."""
    from ...cost.capacity import ModelDims
    from ...kernels.paged import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE
    from ...launch.setup import KernelShape, resolve_launch
    from ..defaults import MAX_SEQ, check_seed
    from .decode import GenerateSpec, ModelShape
    from .memory import REFERENCE_MODES, JobShape, check_job_fits, choose_rows, estimate_generate, read_budget

    check_seed(options.seed)
    if options.reference not in REFERENCE_MODES:
        raise ConfigError(f"--reference must be one of {', '.join(REFERENCE_MODES)}; got {options.reference!r}")
    require_transformers()
    path = None if options.model is None else resolve_model_path(options.model)
    source = ModelSource(path=path, preset=options.preset, layers=options.layers, seed=options.seed,
                         name=options.model if path != options.model else None)
    config = check_source(source)
    shape = ModelShape.from_config(config)
    page = options.page_size
    if not is_int(page) or not MIN_BLOCK_SIZE <= page <= MAX_BLOCK_SIZE:
        raise ConfigError(f"--page-size must be an integer in {MIN_BLOCK_SIZE}..{MAX_BLOCK_SIZE} (the block sizes the "
                          f"decode kernels take); got {page!r}")
    n_new = options.new_tokens
    check_int(n_new, "--new-tokens", minimum=1, maximum=MAX_NEW_TOKENS, must=True)
    max_len = shape.max_positions if options.max_len is None else options.max_len
    check_int(max_len, "--max-len", minimum=2, must=True)
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

    total = len(ids) + n_new
    launch = resolve_launch(options.launch_request(shape=KernelShape(shape.q_heads, shape.kv_heads, shape.head_dim,
                                                                     total), kv_dtype=options.kv_dtype))
    world, dtype, kv_dtype = launch.world_size, launch.dtype, launch.kv_dtype
    notices: list[str] = []
    warnings: list[str] = []
    job = JobShape(ModelDims.from_config(config), n_new, dtype, kv_dtype, launch.device_kind, page,
                   preset=source.random_weights, ring_decode=any(name == "ring" for name, _ in launch.plans))
    budget = read_budget(launch.device_kind)
    spawned = not launch.under_torchrun
    per_node = launch.layout.ranks_per_node if launch.device_kind == "cpu" else 1
    est = estimate_generate(job, len(ids), world, budget, per_node, spawned)
    if budget.known:
        check_job_fits(job, est, len(ids), world, limit=min(max_len - n_new, MAX_SEQ))
    else:
        notices.append(f"free memory unknown ({budget.source}): the capacity estimate "
                       f"({est.job_bytes() / 2**30:,.1f} GiB per {'GPU' if launch.device_kind == 'cuda' else 'node'}) "
                       "is not checked")
    reference, one_rank = choose_rows(options.reference, est)
    if dtype != "float32":
        notices.append(f"{dtype}: rounding differs between the reference and the ranks; a row may part from the "
                       f"reference's tokens (or the row checked against) at a near-tie: both rows' logits for the "
                       f"two tokens within {TIE_ULPS_PER_ROOT_LAYER} x sqrt(layers) ulps, and their logits in "
                       "agreement until then (shown as "
                       "'tie at N', with the gaps); any other difference exits 1")
    if is_fp8(kv_dtype):
        notices.append(f"KV cache {kv_dtype}: quantized as written, with per-layer, per-KV-head scales from the whole "
                       "prompt (the ranks agree on them at prefill); the reference reads its cache quantized the same "
                       "way, so tokens are checked as in 16 bits")
    if source.random_weights:
        notices.append(f"model: {source.label}; random weights, so the output is token ids, not text")
    spec = GenerateSpec(source=source, prompt_ids=tuple(ids), launch=launch, new_tokens=n_new, page_size=page,
                        seed=options.seed, cuda_graph=options.cuda_graph, reference=reference, one_rank=one_rank,
                        estimate=est)
    return GenerateSetup(spec=spec, tokenizer=tokenizer, prompt_text=text, own_notices=tuple(notices),
                         own_warnings=tuple(warnings))
