"""The cost models, one package: the device catalogue (``devices``), the link classes and their one
cost table (``links``), a rank's device and a cluster (``params``), built-in presets with their
sources (``presets``), the kernel's napkin model and the ranking of its configs (``kernel``), the
decode step of tree / allreduce / ring (``step``), the price of a reduction plan on a topology
(``plan``: the step model's merge), parameters from measurements (``fit``) and the
micro-measurements themselves (``calibrate``). Reading a live device's properties (``probe``) and
``calibrate`` import torch; everything else is pure Python, and nothing here imports torch at
import time."""

from .links import LINK_CLASSES, LINK_COSTS, LinkParams
from .params import ClusterSpec, DeviceParams
from .presets import PRESETS, preset
from .step import (
    StepPrediction,
    Workload,
    allreduce_us,
    cluster_hierarchy,
    cluster_plan,
    decode_message_bytes,
    local_attention_us,
    merge_us,
    predict_allreduce,
    predict_ring,
    predict_step,
    predict_tree,
)

__all__ = [
    "LINK_CLASSES", "LINK_COSTS", "PRESETS", "ClusterSpec", "DeviceParams", "LinkParams", "StepPrediction", "Workload",
    "allreduce_us", "cluster_hierarchy", "cluster_plan", "decode_message_bytes", "local_attention_us", "merge_us",
    "predict_allreduce", "predict_ring", "predict_step", "predict_tree", "preset",
]
