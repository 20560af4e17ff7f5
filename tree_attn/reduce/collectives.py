"""``tree_decode``: exact decode attention over KV shards spread across a process group.

Every rank computes the attention of the (shared) query against its own KV shard, giving a partial
state ``(o, lse)``; the states are merged across ranks following a :class:`ReductionPlan`, and
every rank ends with the attention over the union of all shards.

Several query tokens per row (``q [B, Sq, Hq, D]``) merge exactly like heads: a state per (row,
token, head), so the messages are ``[B, Sq * Hq, D + 1]``. With ``causal=True`` the new tokens'
own KV (the last Sq valid keys of each row) is on the **last rank** (``world_size - 1``): that
rank's kernel applies the causal mask, every other rank's keys are in the past of every new
token and are read in full. So the merge is the same merge, and the result is exact.

A paged cache: each rank passes its own pools and block table for its shard's pages.

An fp8 cache (``float8_e4m3fn``): each rank passes its shard's ``k_scale``, ``v_scale`` (its own:
ranks may quantize their shards apart); the local kernel dequantizes, and the states merged
across ranks are float32 as for any cache, so the merge and its messages are unchanged.

Plan once, step many times: :class:`TreeDecoder` resolves the local kernel and the merge
(``reduce.exchange``) for one signature; the public :func:`tree_decode` reuses cached ones, and
:class:`TreeDecodeStep` binds one to static tensors and replays it as a CUDA graph on GPUs.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import partial

import torch
import torch.distributed as dist

from .. import dtypes
from ..errors import DistributedError, ShapeError, TreeAttnError
from ..graphs import CapturedStep, StaticStep, free_communicating_graphs, persistent_buffers
from ..kernels.dispatch import decode_attention
from ..kernels.layout import PACKED
from ..kernels.prepared import DecodeOptions, PreparedDecode, prepared_decode
from ..kernels.shapes import DecodeShape, check_decode_inputs
from . import comm
from .comm import CommStats
from .exchange import AllReduceMerge, TreeMerge, build_merge
from .plan import ReductionPlan, default_plan


def _dtype_code(dtype: torch.dtype) -> int:
    return 1 + dtypes.NAMES.index(dtypes.parse_kv_dtype(dtype))


# A shape descriptor's fields on a rank whose own input checks refused its call.
_REFUSED = -1
# The longest refusal message passed to the other ranks, in bytes (UTF-8).
REFUSAL_BYTES = 512


def exchange_shapes(
    q: torch.Tensor, shape: DecodeShape | None, group, stats: CommStats | None, kv_dtype: torch.dtype | None,
    causal: bool = False, refused: TreeAttnError | None = None,
) -> list[int]:
    """All-gather every rank's (B, Sq, Hq, Hkv, D, q dtype, KV dtype, causal, N); raise if any
    but N disagree.

    Returns each rank's KV length N (a paged shard's: its block table's capacity; the ring
    baseline needs them). One small collective. A KV dtype that differs between ranks would make
    the ring's receive buffers the wrong type (NCCL would reinterpret the bytes silently), so it
    is checked with the rest.

    ``refused``: the error this rank's own input checks raised (``shape`` and ``kv_dtype`` are
    then None). The rank still takes part, sending a descriptor that says so; then every rank
    raises: this one its own error, the others a :class:`DistributedError` that names it and
    quotes its message (one more small collective, on this failure only). Without this, a rank
    that raised before the exchange left its peers waiting out the collective timeout (30 min
    by default) for a message that never came.
    """
    names = ("B", "Sq", "Hq", "Hkv", "D", "q dtype", "KV dtype", "causal")
    if refused is None:
        desc = torch.tensor(
            [shape.batch, shape.q_len, shape.q_heads, shape.kv_heads, shape.head_dim, _dtype_code(q.dtype),
             _dtype_code(kv_dtype), int(causal), shape.kv_len],
            dtype=torch.int64,
            device=q.device,
        )
    else:
        desc = torch.full((len(names) + 1,), _REFUSED, dtype=torch.int64, device=_exchange_device(group, q))
    every = comm.all_gather(desc, group, stats).cpu()
    refusing = [r for r, row in enumerate(every) if int(row[0]) == _REFUSED]
    if refusing:
        texts = _share_refusals(refused, desc.device, group)
        if refused is not None:
            raise refused
        r = refusing[0]
        raise DistributedError(
            f"rank {r} refused its inputs, so no rank can decode them: {texts[r]} "
            f"(fix rank {r}'s call; every rank passes the same q and a valid KV shard)"
        )
    mine = every[dist.get_rank(group)]
    fixed = len(names)
    for r, row in enumerate(every):
        if not torch.equal(row[:fixed], mine[:fixed]):
            diffs = ", ".join(
                f"{n} {_describe_field(n, int(a))} vs {_describe_field(n, int(b))}"
                for n, a, b in zip(names, mine[:fixed], row[:fixed])
                if a != b
            )
            raise DistributedError(
                f"ranks disagree on the query/KV shape: this rank (rank {dist.get_rank(group)}) and rank {r} differ in "
                f"{diffs}; every rank must pass the same q [B, (Sq,) Hq, D] and causal flag, "
                "and KV shards with the same B, Hkv, D and dtype"
            )
    return [int(n) for n in every[:, fixed]]


def _exchange_device(group, q) -> torch.device:
    """Where a refusing rank's descriptor goes: q's device, or (q not a tensor) the backend's."""
    if isinstance(q, torch.Tensor):
        return q.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _share_refusals(refused: TreeAttnError | None, device: torch.device, group) -> list[str]:
    """Every rank's refusal message ("" for ranks that refused nothing), by group rank: one
    all-gather of :data:`REFUSAL_BYTES` bytes per rank."""
    text = b"" if refused is None else f"{type(refused).__name__}: {refused}".encode()[:REFUSAL_BYTES]
    buf = torch.zeros(REFUSAL_BYTES, dtype=torch.uint8)
    buf[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8) if text else buf[:0]
    every = comm.all_gather(buf.to(device), group, None).cpu()
    return [bytes(row[row != 0].tolist()).decode(errors="replace") for row in every]


def checked_inputs(q, k, v, seq_lens, block_table, causal: bool, group, more=None):
    """This rank's input checks before a shape exchange: ``(shape, None)``, or ``(None, error)``
    when they refuse the call, for :func:`exchange_shapes` to tell the other ranks.

    Checks shapes, dtypes, devices and (CPU tensors) values (``check_decode_inputs``), on the
    last rank under ``causal`` that its shard holds the new tokens, and ``more(shape)`` if given
    (the caller's further checks: building the local kernel checks the fp8 scales, impl, config
    and scale)."""
    try:
        shape = check_decode_inputs(q, k, v, seq_lens, block_table, causal, fp8_kv=True)
        if local_causal(causal, group):
            check_new_tokens(q, k, seq_lens, group)
        if more is not None:
            more(shape)
    except TreeAttnError as exc:
        return None, exc
    return shape, None


def _describe_field(name: str, value: int) -> str:
    if name.endswith("dtype") and 1 <= value <= len(dtypes.NAMES):
        return dtypes.NAMES[value - 1]
    return str(value)


def local_causal(causal: bool, group) -> bool:
    """Whether this rank's shard holds the new tokens' KV: the last rank's, under ``causal``."""
    return causal and dist.get_rank(group) == dist.get_world_size(group) - 1


def check_new_tokens(q: torch.Tensor, k: torch.Tensor, seq_lens: torch.Tensor | None, group) -> None:
    """On the last rank under ``causal``: every row's shard must hold the Sq new tokens' keys.

    Reads seq_lens' values (a host sync for GPU tensors: callers run it when a signature is
    prepared, and on CPU tensors per call). Raises :class:`ShapeError` naming the row.
    """
    sq = q.shape[1] if q.dim() == 4 else 1
    world = dist.get_world_size(group)
    lens = [k.shape[1]] * q.shape[0] if seq_lens is None else [int(x) for x in seq_lens.tolist()]
    short = [b for b, n in enumerate(lens) if n < sq]
    if short:
        b = short[0]
        raise ShapeError(
            f"causal decoding over {world} rank(s): the {sq} new tokens' keys must be the last {sq} valid keys "
            f"of the last rank's (rank {world - 1}) shard, but its row {b} has only {lens[b]} valid keys; "
            f"append the new tokens' KV to rank {world - 1}'s shard (and its seq_lens) before the call"
        )


class TreeDecoder:
    """``tree_decode`` for one signature on this rank: a local kernel resolved once (writing the
    packed message in place, :class:`PreparedDecode` with the ``PACKED`` layout) and a prepared
    merge. ``decoder(q, k, v, seq_lens)`` returns views ``(out [B, (Sq,) Hq, D], lse [B, (Sq,) Hq])``
    float32 of the merge's final buffer, valid until the merge's next call.
    """

    def __init__(self, local: PreparedDecode, merge: TreeMerge | AllReduceMerge) -> None:
        s = local.shape
        d = s.head_dim
        self.local, self.merge = local, merge
        # The merge sees Sq * Hq heads; out and lse keep q's layout.
        lead = (s.batch, s.q_len, s.q_heads) if local.tokens else (s.batch, s.q_heads)
        final, mine = merge.final.view(*lead, d + 1), merge.local.view(*lead, d + 1)
        self.out, self.lse = final[..., :d], final[..., d]
        self._local_out, self._local_lse = mine[..., :d], mine[..., d]

    def __call__(
        self, q, k, v, seq_lens=None, stats: CommStats | None = None, block_table=None, *, k_scale=None, v_scale=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.local(q, k, v, seq_lens, self._local_out, self._local_lse, block_table, k_scale=k_scale, v_scale=v_scale)
        self.merge()
        if stats is not None:
            stats.add(self.merge.traffic)
        return self.out, self.lse


def _values(q, k, v) -> tuple:
    """``q, k, v`` detached when one of them requires grad (a model's forward run outside
    ``torch.no_grad``): the merge writes states into buffers shared call after call and receives
    other ranks' states, so tree decoding has no autograd graph; it returns values. Without this,
    the local kernel's in-place write into those buffers was a RuntimeError deep inside torch
    ("a leaf Variable that requires grad is being used in an in-place operation")."""
    try:
        needs_grad = q.requires_grad or k.requires_grad or v.requires_grad
    except AttributeError:  # not tensors: the input checks say so
        return q, k, v
    return (q.detach(), k.detach(), v.detach()) if needs_grad else (q, k, v)


def _group_and_plan(group, plan: ReductionPlan | None) -> tuple:
    """The process group (default: the world) and the plan (default: :func:`default_plan` for
    its size) of a ``tree_decode`` call; raises unless torch.distributed is initialised."""
    comm.require_initialized()
    group = group if group is not None else dist.group.WORLD
    return group, plan or default_plan(dist.get_world_size(group))


def _new_merge(q, k, shape: DecodeShape | None, group, plan: ReductionPlan, check_shapes: bool, causal: bool = False,
               refused: TreeAttnError | None = None):
    """The merge for these shapes, after the shape exchange (``check_shapes``); ``refused``: this
    rank's input checks refused the call (see :func:`checked_inputs`): raised after the exchange,
    which tells the other ranks."""
    if check_shapes:
        exchange_shapes(q, shape, group, None, None if refused is not None else k.dtype, causal, refused)
    elif refused is not None:
        raise refused
    # One state per (row, token, head): the Sq tokens merge as Sq * Hq heads.
    return build_merge(plan, group, shape.batch, shape.q_len * shape.q_heads, shape.head_dim, q.device)


# Prepared merges of the public tree_decode, keyed by what every rank shares (group, plan, q's
# shape, dtypes, device): never a rank's own shard length, so ranks build (and exchange shapes)
# at the same calls even when only one rank's shard grows. The local kernels are cached apart,
# per rank, by kernels.prepared.
_MERGES: OrderedDict[tuple, TreeMerge | AllReduceMerge] = OrderedDict()
MERGE_CACHE_SIZE = 16


def clear_merge_cache() -> None:
    """Drop the cached merges (and with them their references to process groups and buffers).

    Call before ``destroy_process_group``: a cached merge keeps its gloo group alive past it, and a
    gloo group destroyed only at interpreter exit can abort the process (SIGABRT) while it tears
    down its worker threads.
    """
    _MERGES.clear()


def _cached_merge(q, k, v, seq_lens, group, plan: ReductionPlan, check_shapes: bool, block_table=None, causal=False,
                  more=None):
    """The cached merge for this call; inputs are checked whenever a merge is built (and on the
    last rank under ``causal``, that its shard holds the new tokens; ``more``: see
    :func:`checked_inputs`), and a refusal is shared with the other ranks by the shape exchange."""
    try:
        stream = torch.cuda.current_stream(q.device).cuda_stream if q.device.type == "cuda" else 0
        # The group object itself, not None: after destroy_process_group and a new init the default
        # group is a new object, so a merge (and its shape exchange) is never reused across groups.
        resolved = group if group is not None else dist.group.WORLD
        key = (resolved, plan, tuple(q.shape), q.dtype, k.dtype, tuple(k.shape[2:]), q.device, stream, causal)
    except AttributeError:  # not tensors: the checks below refuse the call (and tell the other ranks)
        key = None
    merge = None if key is None else _MERGES.get(key)
    if merge is None:
        shape, refused = checked_inputs(q, k, v, seq_lens, block_table, causal, group, more)
        merge = _new_merge(q, k, shape, group, plan, check_shapes, causal, refused)
        _MERGES[key] = merge
        if len(_MERGES) > MERGE_CACHE_SIZE:
            _MERGES.popitem(last=False)
    else:
        _MERGES.move_to_end(key)
    return merge


def tree_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    *, seq_lens: torch.Tensor | None = None, scale: float | None = None, group=None,
    plan: ReductionPlan | None = None, impl: str = "auto", config=None, check_shapes: bool = True,
    stats: CommStats | None = None, block_table: torch.Tensor | None = None, causal: bool = False,
    k_scale=None, v_scale=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree-attention decoding: a collective over ``group`` (default: the world).

    Args:
        q: ``[B, Hq, D]`` or ``[B, Sq, Hq, D]``, the same on every rank.
        k, v: this rank's KV shard ``[B, N_r, Hkv, D]``; N_r may differ per rank and may be 0. With
            ``block_table``: this rank's pools ``[num_blocks, block_size, Hkv, D]`` holding its
            shard's pages.
        seq_lens: optional int ``[B]``: valid keys of this rank's shard per row (0..N_r); required
            with a block table.
        block_table: this rank's int32 ``[B, max_blocks]`` (see ``decode_attention``), or None.
        causal: the Sq new tokens attend causally among themselves. Their own KV must be the
            last Sq valid keys of the **last rank's** (rank ``world_size - 1``) shard; every
            other rank's keys are in the past of all new tokens. The last rank raises
            :class:`ShapeError` if a row of its shard has fewer than Sq valid keys (checked per
            call for CPU tensors, when the signature is prepared for GPU tensors). Input errors
            found when a signature is first prepared reach every rank through the shape exchange
            (see :func:`exchange_shapes`); one found at a later call on CPU ranks leaves the
            other ranks to stop at their collective's timeout.
        scale: softmax scale (default ``D ** -0.5``).
        plan: the reduction plan (default :func:`reduce.plan.default_plan`).
        impl, config: passed to :func:`decode_attention` for the local shard.
        check_shapes: when the merge for these shapes is first prepared, all-gather a shape
            descriptor and raise :class:`DistributedError` if ranks disagree (every rank must pass
            the same value). Later calls with the same shapes reuse the prepared merge and send
            nothing but the states.
        stats: a :class:`CommStats` to count this rank's messages and bytes into.
        k_scale, v_scale: this rank's dequantization scales for an fp8 shard (see
            ``decode_attention``; each rank's own), else None.

    Returns:
        ``out`` in q's dtype and shape (``[B, Hq, D]`` or ``[B, Sq, Hq, D]``) and ``lse`` float32
        (``[B, (Sq,) Hq]``): attention over the union of all ranks' keys, identical on every rank.
        NaN in any rank's q, k or v gives NaN in that row on every rank; an empty shard is the
        merge's identity. Values only: inputs that require grad are read detached (no autograd
        graph runs through the merge across ranks).
    """
    group, plan = _group_and_plan(group, plan)
    q, k, v = _values(q, k, v)
    # No per-call checks: a merge and a local kernel are prepared (and their inputs checked) for
    # each new signature, and a call that hits both caches has a signature already checked.
    mine = local_causal(causal, group)

    def local_kernel(shape=None) -> PreparedDecode | None:
        # Built (and so checked) before a new merge's shape exchange too: a refusal is then shared.
        if q.numel() == 0:
            return None
        return prepared_decode(q, k, v, seq_lens, block_table=block_table,
                               options=DecodeOptions(scale, impl, config, PACKED, causal=mine), k_scale=k_scale,
                               v_scale=v_scale)

    merge = _cached_merge(q, k, v, seq_lens, group, plan, check_shapes, block_table, causal, local_kernel)
    if mine and q.device.type == "cpu":
        check_new_tokens(q, k, seq_lens, group)
    if q.numel() == 0:
        return decode_attention(
            q, k, v, seq_lens=seq_lens, scale=scale, impl=impl, config=config, block_table=block_table, causal=mine,
            k_scale=k_scale, v_scale=v_scale,
        )
    local = local_kernel()
    out, lse = TreeDecoder(local, merge)(q, k, v, seq_lens, stats, block_table, k_scale=k_scale, v_scale=v_scale)
    # Fresh outputs: the merge's buffers are reused by the next call.
    return out.to(q.dtype, copy=True, memory_format=torch.contiguous_format), lse.clone()


class TreeDecodeStep(StaticStep):
    """A prepared ``tree_decode`` on static tensors, replayed as a CUDA graph on GPUs.

    For decode loops and serving engines that keep static buffers: build it once from the tensors
    the loop will update in place (``q``, ``[B, Hq, D]`` or ``[B, Sq, Hq, D]``; ``k``, ``v`` the
    shard's cache, or its paged pools with ``block_table``, whose contents may change between
    steps; ``seq_lens`` its valid lengths), then each step is ``out, lse = step()``. Block tables
    and, under ``causal``, the last rank's lengths are checked here, once (see ``tree_decode``).
    On GPUs the whole step (the local kernel, the merge kernel, NCCL's sends and receives or
    all-reduces, the output copies) is one graph replay; on CPU ranks it runs eagerly with the same
    prepared objects. ``out`` (q's shape and dtype) and ``lse [B, (Sq,) Hq]`` float32 are static
    too: overwritten by the next step. An fp8 shard takes ``k_scale``, ``v_scale`` (numbers, or
    tensors read at every step: update them in place).

    Building is collective (warm-up steps, and the shape check): every rank builds its step at the
    same point. ``check_values=False``: CPU lengths and block-table values are checked at build
    only, not per step (for a loop that owns them, as ``generate``'s shard does). ``captured``
    says whether the graph is in use, ``why_eager`` why not.

    A call issues the step; ``step.wait()`` waits for it, at most ``timeout_s`` seconds (default:
    the process group's own timeout). NCCL work replayed from a graph has no watchdog, so this is
    the only bound on a step whose peer stalls: on expiry the group is aborted (its waiting NCCL
    kernels return) and :class:`DistributedError` names the rank and the step. Reading the
    outputs (``out.cpu()``, a later kernel) without ``wait()`` waits without a bound.
    """

    @persistent_buffers()
    def __init__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor | None = None,
        *, scale: float | None = None, group=None, plan: ReductionPlan | None = None, impl: str = "auto",
        config=None, check_shapes: bool = True, cuda_graph: bool = True, block_table: torch.Tensor | None = None,
        causal: bool = False, timeout_s: float | None = None, check_values: bool = True, k_scale=None, v_scale=None,
    ) -> None:
        group, plan = _group_and_plan(group, plan)
        q, k, v = _values(q, k, v)  # views of the caller's tensors: in-place updates are seen
        self.tensors = (q, k, v, seq_lens)
        self.block_table = block_table
        self.scales = (k_scale, v_scale)
        mine = local_causal(causal, group)
        built: list[PreparedDecode] = []

        def local_kernel(shape) -> None:
            built.append(PreparedDecode(q, k, v, seq_lens, block_table=block_table, check_values=check_values,
                                        options=DecodeOptions(scale, impl, config, PACKED, causal=mine),
                                        k_scale=k_scale, v_scale=v_scale))

        # Checked once, at build (the step replays without syncing; under causal, the last rank's
        # lengths too), before the shape exchange, which tells every rank if this one refused.
        shape, refused = checked_inputs(q, k, v, seq_lens, block_table, causal, group, local_kernel)
        merge = _new_merge(q, k, shape, group, plan, check_shapes, causal, refused)
        self.decoder = TreeDecoder(built[0], merge)
        self.out = torch.empty_like(q, memory_format=torch.contiguous_format)
        self.lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        # The graph's function holds the step's parts, not the step (no step -> graph -> step
        # cycle: dropping the step frees its graph at once, see graphs.CapturedStep).
        self.graph = CapturedStep(
            partial(_tree_step, self.decoder, self.tensors, self.block_table, self.out, self.lse, self.scales),
            q.device,
            enabled=cuda_graph, communicates=dist.get_world_size(group) > 1,
            timeout_s=timeout_s if timeout_s is not None else group_timeout_s(group),
            abort=partial(abort_group, group), rank=dist.get_rank(), name=f"the {plan.label} decode step",
        )

    @property
    def traffic(self):
        """Messages and bytes this rank sends per step (from the plan)."""
        return self.decoder.merge.traffic

    def __call__(self, stats: CommStats | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        result = self.graph()
        if stats is not None:
            stats.add(self.traffic)
        return result


def _tree_step(decoder: TreeDecoder, tensors: tuple, block_table, out: torch.Tensor,
               lse: torch.Tensor, scales: tuple = (None, None)) -> tuple[torch.Tensor, torch.Tensor]:
    """One :class:`TreeDecodeStep` on its static tensors (what its graph captures)."""
    if out.numel() == 0:
        return out, lse
    o, l = decoder(*tensors, None, block_table, k_scale=scales[0], v_scale=scales[1])
    out.copy_(o)
    lse.copy_(l)
    return out, lse


def group_timeout_s(group=None) -> float | None:
    """The collective timeout ``group`` was created with, in seconds (None when torch does not
    say: an unknown backend)."""
    try:
        pg = group if group is not None else dist.group.WORLD
        device = torch.device("cuda" if dist.get_backend(pg) == "nccl" else "cpu")
        return pg._get_backend(device).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - private attributes: absent in some torch build, then no bound
        return None


def abort_group(group=None) -> str:
    """Abort ``group`` (default: every group) without waiting for its peers: NCCL aborts its
    communicators (``ncclCommAbort``), so kernels waiting on a peer that never comes return.
    ``destroy_process_group`` would wait for them instead. Returns what was done, for an error
    message. (``_abort_process_group`` is torch's, experimental, since 2.5.)"""
    if not dist.is_available() or not dist.is_initialized():
        return "no process group was left to abort"
    world = group is None or group == dist.group.WORLD
    clear_merge_cache()  # the cached merges hold the group
    # NCCL's abort waits until every graph holding its kernels is destroyed: free them first.
    free_communicating_graphs("its process group was aborted")
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        abort(None if world else group)
    else:  # torch without it: the backend's own abort
        (dist.group.WORLD if world else group).abort()
    return "the process group was aborted" if world else "its process group was aborted"
