"""The decode step as one compiled graph: no per-layer Python when every sequence of a step decodes one token.

(A bf16 Llama-family model on CPU decodes through engine/native_step.py instead, the whole step one C++ call with
nothing to compile; this graph serves every model that path does not take, and that path's batches above 64.)

At batch 1 a decode step of SmolLM2-135M is ~150 small ops per layer's worth of Python dispatch around a few
GEMVs: measured on a 2-core Xeon (1 thread, int4 g64), the 30 decoder layers took 23 ms eagerly against 11.6 ms
compiled, of which the int4 GEMVs are ~9 ms. `torch.compile` (inductor's CPU backend) fuses the norms, RoPE,
residuals and SwiGLU into a few C++ loops and calls the aten GEMM ops directly.

What stays outside the graph is attention over the paged KV cache: its plan depends on the step's block tables
(host data), so it is the custom op `tokq::paged_attend`, opaque to the compiler, whose implementation is the
runner's own `PagedAttention` backend (the same write and attention kernels as the eager path, so the cache a
compiled step writes is the cache an eager prefill reads). The op finds that backend through `active_backend`,
set by the runner around each compiled call: the graph itself holds no engine state, so one compiled graph per
model serves every engine built on it.

When every layer's attention kernel is tokq's native one (`cpu_native_paged`, kernels/cpu/native_attention.py),
the graph skips the Python op: `NativeGraphAttention` hands each layer's caches and the step's metadata to the C++
op `tokq_native::paged_decode_step` (KV write + attention) as graph inputs, so a decode step runs no Python per
layer. Measured step-alternated on a 2-core Xeon (SmolLM2 int4 + int8 head, 2 threads, ~600 keys): 1.41x the
step through `tokq::paged_attend` with SDPA, against 1.27x for the same native kernel behind the Python op.

Only pure decode steps run compiled (prefill chunks have other shapes and stay eager); the first batch size
compiles a static graph and the next a dynamic one for the rest, so a server compiles at most twice per model
(95 s for both of SmolLM2's on a 2-core Xeon, 13 s from inductor's on-disk cache in a later process).
Inductor's C++ wrapper (`cpp_wrapper`) was measured and left off: 1.03-1.06x a step, but 227 s to compile both. When the
compiler is missing or fails, the engine logs why once and runs that model eagerly.

`TOKQ_COMPILE=0` turns compilation off (the test suite does, except the tests of this path); an
`EngineConfig(compile_decode=...)` overrides the environment.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import types
from collections.abc import Callable

import torch

from tokq.engine.attention import AttentionSpec

log = logging.getLogger("tokq")

ENV = "TOKQ_COMPILE"
MAX_COMPILED_BATCH = 64  # larger decode batches run eagerly (rare; their GEMMs dominate anyway)

_state = threading.local()


def compile_enabled(override: bool | None = None) -> bool:
    """Whether decode steps are compiled: the override when given, else $TOKQ_COMPILE (default on)."""
    if override is not None:
        return override
    return (os.environ.get(ENV, "").strip().lower() or "1") not in ("0", "false", "no", "off")


class active_backend:
    """Context manager: the paged backend `tokq::paged_attend` calls while a compiled step runs (per thread)."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def __enter__(self) -> None:
        self.previous = getattr(_state, "backend", None)
        _state.backend = self.backend

    def __exit__(self, *exc) -> None:
        _state.backend = self.previous


@torch.library.custom_op("tokq::paged_attend", mutates_args=())
def paged_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
                 sliding_window: int) -> torch.Tensor:
    """Write k/v [1, T, Hkv, D] into layer `layer`'s paged cache and attend q [1, T, Hq, D] through it.

    The cache write is a side effect the compiler does not see; it is safe because nothing in the graph reads
    the cache but this op, and each layer's call depends on the previous layer's output."""
    backend = getattr(_state, "backend", None)
    if backend is None:
        raise RuntimeError("tokq::paged_attend called outside a compiled decode step (no active paged backend)")
    spec = AttentionSpec(layer, scale, sliding_window if sliding_window > 0 else None)
    # The compiled code reads the result with the strides of the fake below (contiguous, q's): a kernel may
    # return a transposed view, which read that way is garbage.
    return backend.attend(q, k, v, spec).contiguous()


@paged_attend.register_fake
def _paged_attend_shape(q, k, v, layer, scale, sliding_window):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


class GraphAttention:
    """The attention backend the compiled graph is traced with: every layer's attention is the custom op."""

    name = "compiled-paged"

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
        return torch.ops.tokq.paged_attend(q, k, v, spec.layer, spec.scale, spec.sliding_window or 0)


GRAPH_ATTENTION = GraphAttention()


class NativeGraphAttention:
    """The attention backend a compiled step is traced with when every layer runs tokq's native decode attention
    (`cpu_native_paged`): each layer's KV write and attention is one C++ op, `tokq_native::paged_decode_step`,
    called straight from the graph, with the layer's caches and the step's metadata as graph inputs (attributes of
    this object, which dynamo lifts). No Python runs per layer: through `tokq::paged_attend` it was ~45 us a layer
    (1.4 ms of a 14 ms SmolLM2 step at 2 threads).

    One per runner; `set_step` points it at a step's tensors. The block tables' width grows with the sequences and
    the caches' number of blocks differs between engines, so both are marked dynamic (either would otherwise
    recompile: an engine with another pool size once cost a 7 s compile inside a benchmark) and the width is kept
    >= 2 (dynamo specializes sizes 0 and 1)."""

    name = "compiled-native-paged"

    def __init__(self, caches: list[tuple[torch.Tensor, torch.Tensor]], group_of: list[int]) -> None:
        for pair in caches:  # pools differ in size between engines: one graph serves them all
            for cache in pair:
                torch._dynamo.maybe_mark_dynamic(cache, 0)
        self.caches = caches
        self.group_of = tuple(group_of)
        self.slots: list[torch.Tensor] = []
        self.tables: list[torch.Tensor] = []
        self.seq_lens: list[torch.Tensor] = []
        self.query_starts: list[torch.Tensor] = []

    def set_step(self, slot_mappings: list[torch.Tensor], metas: list) -> None:
        self.slots = slot_mappings
        self.tables = []
        for meta in metas:
            table = meta.block_tables
            if table.shape[1] < 2:
                table = torch.nn.functional.pad(table, (0, 2 - table.shape[1]))
            torch._dynamo.maybe_mark_dynamic(table, 1)
            self.tables.append(table)
        self.seq_lens = [meta.seq_lens for meta in metas]
        self.query_starts = [meta.query_start_loc for meta in metas]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
        group = self.group_of[spec.layer]
        k_cache, v_cache = self.caches[spec.layer]
        out = torch.ops.tokq_native.paged_decode_step(q[0], k[0], v[0], k_cache, v_cache, self.slots[group],
                                                      self.tables[group], self.seq_lens[group],
                                                      self.query_starts[group], spec.scale, spec.sliding_window or 0)
        return out.unsqueeze(0)
_COMPILED_ATTR = "_tokq_compiled_decode"
compiled_steps = 0  # steps run through a compiled graph in this process (tests and benchmarks read it)
_FAILED_ATTR = "_tokq_compile_failed"


def model_fingerprint(model: torch.nn.Module) -> tuple:
    """What the compiled graph was traced against: every module, parameter and buffer object, and each quantized
    layer's prepared kernel. Checked once per engine (ModelRunner), so that a model changed in place after a
    compile (a layer quantized, a head untied, weights moved) gets a fresh graph."""
    kernels = tuple(id(getattr(m, "kernel", None)) for m in model.modules())
    return (tuple(id(m) for m in model.modules()), tuple(id(t) for t in model.parameters()),
            tuple(id(t) for t in model.buffers()), kernels)


_forward_copies = itertools.count()


def _own_forward(model: torch.nn.Module) -> Callable:
    """`model.forward` bound to a copy of its function with a code object of its own, so that dynamo keeps this
    model's compiled graphs in a cache no other model's calls walk."""
    fn = type(model).forward
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_tokq{next(_forward_copies)}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    return types.MethodType(copy, model)


def compiled_forward(model: torch.nn.Module, fingerprint: tuple | None = None) -> Callable | None:
    """The model's compiled forward (made once per model and fingerprint), or None when compiling failed for it.

    Dynamo's guards on the model's modules are skipped (`skip_guard_on_all_nn_modules_unsafe`): checking every
    parameter on every call cost ~1.5 ms a step (30 layers). Two things stand in for them: each model's graphs are
    isolated from every other model's, and the fingerprint is compared when an engine is built (not per step,
    which is enough because an engine never changes its model)."""
    if getattr(model, _FAILED_ATTR, None):
        return None
    fingerprint = fingerprint or model_fingerprint(model)
    cached = getattr(model, _COMPILED_ATTR, None)
    if cached is not None and cached[0] == fingerprint:
        return cached[1]
    # isolate_recompiles: this model's graphs are its own. Dynamo caches per code object, and without guards on
    # the module a second model would otherwise run the first one's graph. The forward is also compiled from a code
    # object of its own (`_own_forward`): with every model on CausalLM.forward's, a step of the model compiled second
    # in a process first evaluated (and failed) the other model's guards, which made it ~12% slower a SmolLM2 step on
    # a 2-core Xeon than the same model compiled first (a bias in any paired run: the gate's base and variant).
    # size_asserts off: inductor's wrapper checks every input's and extern op output's sizes and strides on every
    # call, ~640 checks a SmolLM2 step (5% of a 2-thread int4 step, step-alternated). What they guard against, an op
    # returning another layout than its fake declares, is what tests/test_compiled_decode.py's compiled-vs-eager
    # equality checks catch, and tokq's ops return contiguous outputs (`paged_attend` makes its own so).
    fn = torch.compile(_own_forward(model), dynamic=None, isolate_recompiles=True,
                       options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                                "size_asserts": False})
    object.__setattr__(model, _COMPILED_ATTR, (fingerprint, fn))  # not a submodule or parameter: not in state_dict
    return fn


def run_compiled(model: torch.nn.Module, backend, input_ids: torch.Tensor, positions: torch.Tensor,
                 fingerprint: tuple | None = None, graph_attention=None) -> torch.Tensor | None:
    """The model's forward through its compiled graph with `backend` serving attention; None when the compiler
    cannot handle this model (logged once; the caller runs the step eagerly and this model stays eager).
    `fingerprint`: `model_fingerprint(model)` as the caller's engine found it (computed here when None).
    `graph_attention`: what the graph calls for attention (a `NativeGraphAttention` set to this step), else
    `tokq::paged_attend` into `backend`."""
    fn = compiled_forward(model, fingerprint)
    if fn is None:
        return None
    global compiled_steps
    try:
        with active_backend(backend):
            hidden = fn(input_ids, positions, graph_attention or GRAPH_ATTENTION)
        compiled_steps += 1
        return hidden
    except torch._dynamo.exc.TorchDynamoException as exc:  # a compiler failure, not a bad request
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("compiling the decode step failed (%s); %s decodes eagerly (set %s=0 to skip compiling)",
                    first_line[:200], getattr(model, "name", "the model"), ENV)
        object.__setattr__(model, _FAILED_ATTR, True)
        return None
