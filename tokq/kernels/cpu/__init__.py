"""CPU paths over native torch ops (no compiled code of tokq's own); the registry decides when each runs."""

from .attention import paged_attention_cpu, write_kv_cpu
from .linear import (
    Int4PackState,
    Int8PackState,
    W8A8State,
    dequant_dense_supports,
    int4pack_supports,
    int8pack_supports,
    prepare_dequant_dense,
    prepare_int4pack,
    prepare_int8pack,
    prepare_w8a8,
    run_dequant_dense,
    run_int4pack,
    run_int8pack,
    run_w8a8,
    w8a8_supports,
)

__all__ = [
    "Int4PackState", "Int8PackState", "W8A8State", "dequant_dense_supports", "int4pack_supports", "int8pack_supports", "prepare_dequant_dense",
    "prepare_int4pack", "prepare_int8pack", "prepare_w8a8", "run_dequant_dense", "run_int4pack", "run_int8pack",
    "run_w8a8", "w8a8_supports", "paged_attention_cpu", "write_kv_cpu",
]
