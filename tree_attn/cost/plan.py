"""The price of one all-ranks merge under a reduction plan on a topology: how ``tune`` ranks the
candidate plans where nothing can be timed (the built-in profiles, derived from recorded topology
dumps, and ``tune`` from a topology file).

It is the step model's merge (:func:`tree_attn.cost.step.merge_us`) on the one-node cluster the
topology describes (:func:`tree_attn.cost.fit.cluster_from_topology`: each pair's link class from
the one link-class table, a measured link's own numbers where the topology has them, the device
from the catalogue or by vendor). So a plan priced here and the same plan in ``simulate`` on that
topology cost the same, by construction. Its numbers are model figures, not measurements; a
profile says ``chosen_by: model`` wherever they decided.
"""

from __future__ import annotations

from ..reduce.plan import ReductionPlan
from ..topology.model import Topology
from .fit import cluster_from_topology, topology_device
from .params import ClusterSpec
from .step import decode_lse_bytes, decode_message_bytes, merge_us


def plan_cluster(topology: Topology) -> ClusterSpec:
    """The one-node cluster plans on ``topology`` are priced on (rank r on device r)."""
    return cluster_from_topology(topology, device=topology_device(topology))


def predict_plan_us(plan: ReductionPlan, topology: Topology, message_bytes: int, lse_bytes: int = 0) -> float:
    """Predicted microseconds for every rank to hold the merged state under ``plan`` (rank r on
    device r; ``message_bytes`` per packed partial state, ``lse_bytes`` the lse the all-reduce
    form reduces first, :func:`decode_lse_bytes`; 0 leaves out its byte term, a few bytes per
    row and head)."""
    return merge_us(plan_cluster(topology), plan, message_bytes, lse_bytes)


__all__ = ["decode_lse_bytes", "decode_message_bytes", "plan_cluster", "predict_plan_us"]
