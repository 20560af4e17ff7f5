"""Rank processes: spawn one per rank (CPU/gloo, or one GPU each) or join a torchrun job.

Below ``runner`` and ``topology.measure``, which both start ranks; imports nothing of the project
but ``errors``.
"""
