"""Kernels behind the runtime seams: reference paths, CPU paths over native torch ops, Triton. Imports nothing else of tokq but tokq.dtypes and tokq.errors."""

ENV = "TOKQ_KERNELS"  # kernel names to force, or to disable with a leading '-' (kernels/registry.py)
