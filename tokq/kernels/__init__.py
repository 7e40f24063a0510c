"""Kernels behind the runtime seams: reference paths, CPU paths over native torch ops, Triton. Imports nothing else of tokq."""
