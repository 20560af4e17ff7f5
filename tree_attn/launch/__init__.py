"""Launching a job's ranks: spawned processes (one per CPU rank or GPU) or a torchrun job.

Below ``commands`` (the back ends of run, generate and tune), ``topology.measure`` and
``cost.calibrate``, which all start ranks. Modules here import the library core lazily, inside
functions, so that the core may start ranks through them without an import cycle.
"""
