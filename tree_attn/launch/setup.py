"""A job's launch, resolved once.

:func:`resolve_launch` turns what a command was asked (a :class:`LaunchRequest`: ``--device``,
``--world-size``, ``--backend``, ``--timeout``, ``--dtype``, the strategies and ``--profile``) into
a :class:`LaunchSetup`: where the ranks compute, how many there are and how they talk, whether this
process is one rank of a torchrun job (and the job's node layout), the profile the job runs under,
its plans and the kernel config for its shape. ``run``, ``generate``, ``tune`` and ``probe
--measure`` resolve through it; each command's spec embeds the result, and everything downstream
(the rank job runner, the ranks themselves) trusts it and resolves nothing again.

Everything that looks at the machine (GPUs visible to torch, torchrun's variables, the topology,
saved and built-in profiles) happens here, before anything is allocated or started; nothing is
printed: what a user should read comes back as ``notices`` and ``warnings``. No torch import at
module level (``tree-attn --help`` imports the commands' option defaults).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from ..errors import ConfigError
from ..validate import check_int, is_int
from .env import DEFAULT_TIMEOUT_S, NodeLayout, RankEnv, check_timeout

if TYPE_CHECKING:  # pragma: no cover
    from ..kernels.config import DecodeConfig
    from ..reduce.plan import ReductionPlan
    from .plans import ProfileChoice

AUTO = "auto"  # decide from the machine (--device, --backend, --dtype, --strategy)
CONCRETE_DEVICES = ("cpu", "cuda")
CONCRETE_BACKENDS = ("gloo", "nccl")


def default_dtype(device_kind: str) -> str:
    """The dtype of ``--dtype auto``: bfloat16 on GPU ranks (what checkpoints ship in, half the
    bytes of float32, and the 16-bit kernel builds, where float32's spill registers), float32 on
    CPU ranks (16-bit arithmetic is slow on most CPUs, and float32 keeps results closest to the
    float64 reference)."""
    return "bfloat16" if device_kind == "cuda" else "float32"


@dataclass(frozen=True)
class KernelShape:
    """The attention shape a job's kernel config is chosen for: query heads, KV heads, head dim
    and the total KV tokens, split over the ranks (the config is the profile's for the largest
    shard)."""

    q_heads: int
    kv_heads: int
    head_dim: int
    tokens: int

    def __post_init__(self) -> None:
        for name in ("q_heads", "kv_heads", "head_dim"):
            value = getattr(self, name)
            check_int(value, name.replace("_", " "), positive=True, must=True)
        if not is_int(self.tokens) or self.tokens < 0:
            raise ConfigError(f"sequence length must be >= 0; got {self.tokens!r}")
        if self.q_heads % self.kv_heads:
            raise ConfigError(f"query heads ({self.q_heads}) must be a multiple of KV heads ({self.kv_heads}) for "
                              "grouped-query attention")


@dataclass(frozen=True)
class LaunchOptions:
    """The launch options a command takes: ``--world-size``, ``--device``, ``--backend``,
    ``--dtype``, ``--timeout``; None and ``"auto"`` mean "decide from the machine". Commands'
    options dataclasses extend it, so each of these is declared (and defaulted) once."""

    world_size: int | None = None
    device: str = AUTO
    backend: str = AUTO
    dtype: str = AUTO
    timeout_s: float = DEFAULT_TIMEOUT_S

    def launch_request(self, **more) -> LaunchRequest:
        """A :class:`LaunchRequest` of these options (the plans' too, where the command has them),
        with ``more`` (the job's shape, ...)."""
        own = {f.name: getattr(self, f.name) for f in fields(PlanOptions) if hasattr(self, f.name)}
        return LaunchRequest(**{**own, **more})


@dataclass(frozen=True)
class PlanOptions(LaunchOptions):
    """The launch options of a command that decodes (``run``, ``generate``), and its plans':
    ``--strategy``, ``--fanout``, ``--profile``, ``--plan``."""

    strategy: str = AUTO
    fanout: int | None = None
    profile: str | None = None
    plan: str = AUTO  # the tree's shape: auto, hier or flat (launch.plans.PLAN_SHAPES)


@dataclass(frozen=True)
class LaunchRequest(PlanOptions):
    """What a command asks of its launch (see :class:`LaunchOptions`, :class:`PlanOptions`).

    ``strategy`` None: the job runs no decode plans (nor profile, nor kernel config: ``tune``,
    ``probe --measure``). ``join_torchrun``: under torchrun's variables this process joins the job
    as one rank (``run``, ``generate``); off, the command always spawns its own ranks. ``shape``:
    the shape the kernel config is looked up for (None: none). ``activity`` and ``timed`` word the
    notice and the warning about CPU ranks ("spawning 4 CPU ranks"; "step times swing").
    ``kv_dtype``: the KV cache's dtype (None: ``dtype``'s; ``fp8`` = ``float8_e4m3fn``), which picks
    the profile's kernel config (``run --kv-dtype``, ``tune --kv-dtype``).
    """

    strategy: str | None = None
    join_torchrun: bool = True
    shape: KernelShape | None = None
    activity: str = "spawning"
    timed: str = "step times"
    kv_dtype: str | None = None


@dataclass(frozen=True)
class LaunchSetup:
    """A resolved launch. Build it with :func:`resolve_launch` from user options; tests and
    benchmarks that know exactly what they want may construct it directly.

    Attributes:
        world_size: ranks of the job.
        device_kind: ``cpu`` (one process per rank, gloo) or ``cuda`` (one GPU per rank).
        backend: ``gloo`` or ``nccl`` (RCCL on ROCm builds of torch), never ``auto``.
        timeout_s: how long a collective may wait for a peer; the parent gives a spawned rank up
            after this much silence plus a margin.
        dtype: the job's queries, outputs and weights (``float32``, ``float16``, ``bfloat16``).
        kv_dtype: the job's KV cache: ``dtype`` (None is resolved to it), another of those, or
            ``float8_e4m3fn`` (an fp8 cache with per-KV-head scales). The kernel config is the
            profile's for this dtype.
        torchrun: this process's place in a torchrun job, or None when the job spawns its ranks.
        layout: nodes x ranks per node (one node unless a torchrun job spans several).
        profile: which profile the job runs under and why (None for jobs without plans).
        plans: ``(strategy, ReductionPlan | None)`` pairs (``ring`` has no plan).
        kernel_config: the profile's kernel config for the job's shape, or None (the default
            heuristic picks one per call).
        notices, warnings: what to tell the user about this launch, once.
    """

    world_size: int = 1
    device_kind: str = "cpu"
    backend: str = "gloo"
    timeout_s: float = DEFAULT_TIMEOUT_S
    dtype: str = "float32"
    kv_dtype: str | None = None
    torchrun: RankEnv | None = None
    layout: NodeLayout | None = None
    profile: ProfileChoice | None = None
    plans: tuple[tuple[str, ReductionPlan | None], ...] = ()
    kernel_config: DecodeConfig | None = None
    notices: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        from ..dtypes import parse_dtype, parse_kv_dtype
        from .plans import STRATEGY_NAMES

        world = self.world_size
        check_int(world, "world size", positive=True, must=True)
        if self.device_kind not in CONCRETE_DEVICES:
            raise ConfigError(f"device kind must be one of {', '.join(CONCRETE_DEVICES)}; got {self.device_kind!r}")
        if self.backend not in CONCRETE_BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(CONCRETE_BACKENDS)} (resolved); got {self.backend!r}")
        check_timeout(self.timeout_s, "timeout_s")
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        object.__setattr__(self, "kv_dtype", self.dtype if self.kv_dtype is None else parse_kv_dtype(self.kv_dtype))
        layout = self.layout if self.layout is not None else NodeLayout(1, world, 0)
        if layout.nodes < 1 or layout.nodes * layout.ranks_per_node != world:
            raise ConfigError(f"nodes must be a positive integer dividing the world size {world}; got {layout.nodes!r}")
        object.__setattr__(self, "layout", layout)
        if self.torchrun is not None and self.torchrun.world_size != world:
            raise ConfigError(f"torchrun started {self.torchrun.world_size} ranks but the world size is {world}")
        for name, plan in self.plans:
            if name not in STRATEGY_NAMES:
                raise ConfigError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGY_NAMES)}")
            if plan is not None:
                plan.check(world)

    @property
    def under_torchrun(self) -> bool:
        """This process is one rank of a torchrun job (the job does not spawn its ranks)."""
        return self.torchrun is not None

    @property
    def rank(self) -> int:
        """This process's rank under torchrun (only rank 0 speaks), else 0."""
        return self.torchrun.rank if self.torchrun is not None else 0

    @property
    def nodes(self) -> int:
        return self.layout.nodes

    def shard_sizes(self, tokens: int) -> list[int]:
        """``tokens`` split over the ranks in contiguous shards, as evenly as possible: the first
        ``tokens % world_size`` ranks hold one more."""
        base, extra = divmod(tokens, self.world_size)
        return [base + (1 if r < extra else 0) for r in range(self.world_size)]


def _from_launch(name: str) -> property:
    return property(lambda self: getattr(self.launch, name), doc=f"The launch's ``{name}``.")


class OnLaunch:
    """The launch's facts read through a spec that embeds a :class:`LaunchSetup` as ``launch``
    (the specs of run and generate, tune's options): one source for each, no copies to drift."""

    launch: LaunchSetup
    world_size = _from_launch("world_size")
    device_kind = _from_launch("device_kind")
    backend = _from_launch("backend")
    dtype = _from_launch("dtype")
    kv_dtype = _from_launch("kv_dtype")
    timeout_s = _from_launch("timeout_s")
    plans = _from_launch("plans")
    kernel_config = _from_launch("kernel_config")


class AnnouncesLaunch:
    """A command's resolved setup whose ``spec`` embeds a launch: what the CLI announces before
    the job (the profile, the notices and warnings, once: on rank 0 under torchrun) is the
    launch's, then the command's own (``own_notices``, ``own_warnings``)."""

    spec: OnLaunch
    own_notices: tuple[str, ...] = ()
    own_warnings: tuple[str, ...] = ()

    @property
    def profile(self) -> ProfileChoice:
        return self.spec.launch.profile

    @property
    def notices(self) -> tuple[str, ...]:
        return self.spec.launch.notices + self.own_notices

    @property
    def warnings(self) -> tuple[str, ...]:
        return self.spec.launch.warnings + self.own_warnings

    @property
    def under_torchrun(self) -> bool:
        return self.spec.launch.under_torchrun

    @property
    def rank(self) -> int:
        """This process's rank under torchrun (only rank 0 speaks), else 0."""
        return self.spec.launch.rank


def resolve_launch(request: LaunchRequest) -> LaunchSetup:
    """Resolve ``request`` against this machine, once.

    Checks come before anything is built in proportion to a number (the timeout, the device,
    torchrun's variables, the world size against the GPUs or the CPU-rank limit), then the backend
    and the dtype, then the plans: the profile (which may read the topology of ``world_size``
    ranks) and the kernel config for ``request.shape``. Raises ConfigError naming the option, or
    ProfileError for a profile that does not apply. Nothing is started.
    """
    from ..dtypes import parse_dtype, parse_kv_dtype
    from ..topology.host import default_cpu_ranks
    from .env import (
        check_cpu_ranks,
        oversubscription_warning,
        resolve_backend,
        resolve_device_kind,
        torchrun_env,
        torchrun_layout,
        torchrun_rendezvous,
    )

    check_timeout(request.timeout_s)
    kind, n_gpus = resolve_device_kind(request.device)
    env = torchrun_env(kind, request.backend) if request.join_torchrun else None
    if env is not None:
        torchrun_rendezvous(env)  # MASTER_ADDR / MASTER_PORT named if missing, before anything is printed
        if request.world_size is not None and request.world_size != env.world_size:
            raise ConfigError(f"torchrun started {env.world_size} ranks but --world-size is {request.world_size}; "
                              "omit --world-size under torchrun")
    world = request.world_size
    if world is None:
        world = env.world_size if env is not None else (n_gpus if kind == "cuda" else default_cpu_ranks())
    check_int(world, "--world-size", minimum=1, must=True)
    notices: list[str] = []
    warnings: list[str] = []
    if env is None and kind == "cuda" and world > n_gpus:
        raise ConfigError(f"world size {world} is larger than the {n_gpus} GPUs of this machine")
    if env is None and kind == "cpu":
        check_cpu_ranks(world)
        why = "no GPU in use" if request.device == AUTO else "--device cpu"
        notices.append(f"{why}: {request.activity} {world} CPU rank{'s' if world != 1 else ''} (gloo)")
        crowded = oversubscription_warning(world, request.timed)
        if crowded:
            warnings.append(crowded)
    backend = env.backend if env is not None else resolve_backend(request.backend, kind)
    dtype = parse_dtype(default_dtype(kind) if request.dtype == AUTO else request.dtype)
    kv_dtype = dtype if request.kv_dtype in (None, AUTO) else parse_kv_dtype(request.kv_dtype)
    layout = torchrun_layout(env) if env is not None else NodeLayout(1, world, 0)
    profile = plans = kernel_config = None
    if request.strategy is not None:
        from .plans import choose_plans, kernel_config_for, parse_strategies

        names = parse_strategies(request.strategy)
        found, profile, profile_warnings, plans = choose_plans(request.profile, names, request.fanout, world, kind,
                                                              layout, shape=request.plan)
        warnings.extend(profile_warnings)
        if request.shape is not None:
            s = request.shape
            kernel_config = kernel_config_for(found, kv_dtype, s.q_heads, s.kv_heads, s.head_dim, s.tokens, world)
    return LaunchSetup(
        world_size=world, device_kind=kind, backend=backend, timeout_s=request.timeout_s, dtype=dtype,
        kv_dtype=kv_dtype, torchrun=env,
        layout=layout, profile=profile, plans=plans or (), kernel_config=kernel_config, notices=tuple(notices),
        warnings=tuple(warnings),
    )
