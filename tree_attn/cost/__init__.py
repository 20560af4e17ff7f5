"""The decode-step cost model: link classes, devices and clusters (``params``), built-in presets
with their sources (``presets``), predictions for tree / allreduce / ring (``model``) and
parameters from measurements (``fit``). Pure Python: no torch at import time."""

from .step import (
    StepPrediction, Workload, allreduce_us, cluster_hierarchy, cluster_plan, local_attention_us, predict_allreduce,
    predict_ring, predict_step, predict_tree,
)
from .params import LINK_CLASSES, ClusterSpec, DeviceParams, LinkParams
from .presets import PRESETS, preset

__all__ = [
    "LINK_CLASSES", "ClusterSpec", "DeviceParams", "LinkParams", "PRESETS", "preset",
    "StepPrediction", "Workload", "allreduce_us", "cluster_hierarchy", "cluster_plan", "local_attention_us",
    "predict_allreduce", "predict_ring", "predict_step", "predict_tree",
]
