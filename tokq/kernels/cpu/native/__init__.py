"""tokq's native CPU decode kernels (gemv.cpp): built once per machine, loaded as torch ops `tokq_native::*`.

torch's CPU weight-only ops are compute-bound at decode shapes: on a 2-core Xeon at 1 thread,
`_weight_int8pack_mm` runs SmolLM2's 49152 x 576 int8 LM head at 4.5-4.9 GB/s (6.3 ms) and
`_weight_int4pack_mm_for_cpu` its decoder GEMVs at ~5 GB/s. gemv.cpp quantizes the activations to int8 per
block and does the dot products in integer SIMD (VNNI or AVX2), reading each weight once per call: the LM head
in 0.9 ms at 1 thread and 0.5 ms at 2 (weights warm in cache; 1.4 / 0.8 ms before its 4-rows-at-a-time loop), the
decoder's int4 GEMVs 1.1-1.2x aten's op at one row and 1.9-2.7x at 16 (the tiled layout, `pack_int4_tiled`).

The library is compiled at first use with the C++ compiler found ($CXX, g++ or c++) against the running torch's
headers, `-O3 -march=native`, into `$TOKQ_HOME/native/<hash>/` (the hash covers the source, the torch version, the
compiler's version and the CPU's flags, so another machine or torch builds its own), written atomically. About
10 s on 2 cores, once. Without a compiler, or when the build fails, `unavailable()` says why and the registry
picks torch's ops instead. `TOKQ_NATIVE=0` turns the kernels off.

Registered ops: in gemv.cpp `int4_gemv(x, packed, scale, zero, group)` (row-major layout, `pack_int4`),
`int4_gemv_tiled(x, packed, scale_t, zb_t, group)` (AVX-512 VNNI builds; `pack_int4_tiled`), `int8_gemv(x, q, qu,
scale)`, `bf16_gemv(x, w)`, `isa()`; in
attention.cpp (paged decode attention) `paged_decode(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
scale, window)`, `paged_write(k, v, k_cache, v_cache, slots)` and `paged_decode_step` (the two in one call, for the
compiled decode graph); in decode_step.cpp the class `torch.classes.tokq_native.LlamaDecoder` (a Llama-family decode
step in one call, engine/native_step.py). Fake implementations are registered here so that torch.compile can trace through them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCES = [Path(__file__).with_name(name) for name in ("gemv.cpp", "attention.cpp", "decode_step.cpp")]
ENV = "TOKQ_NATIVE"
_lock = threading.Lock()
_state: dict = {}


def _home() -> Path:
    # kernels import nothing of tokq but its leaves: $TOKQ_HOME as tokq.paths reads it
    return Path(os.environ.get("TOKQ_HOME", "~/.cache/tokq")).expanduser()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _compiler() -> str | None:
    for candidate in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def _march() -> str:
    """The instruction set to compile for: this CPU's, unless $TOKQ_NATIVE_MARCH names another (the tests build
    the AVX2 and plain-C paths that way on a CPU that would pick AVX-512)."""
    return os.environ.get("TOKQ_NATIVE_MARCH", "native")


def _build(compiler: str, out: Path) -> None:
    from torch.utils.cpp_extension import include_paths

    lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [compiler, "-O3", f"-march={_march()}", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-w",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in include_paths()), *map(str, SOURCES), "-o", str(out),
           f"-L{lib}", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if "error" in ln] or proc.stderr.splitlines() or ["no output"]
        raise RuntimeError(f"{Path(compiler).name} failed: {lines[0][:300]}")


def _load() -> str | None:
    """Build (if needed) and load the library; returns why it is unavailable, None when loaded."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"turned off by {ENV}=0"
    if not hasattr(torch.ops, "tokq_native") or not hasattr(torch.ops.tokq_native, "paged_decode_step"):
        compiler = _compiler()
        if compiler is None:
            return "no C++ compiler found ($CXX, g++, c++ or clang++) to build tokq's native kernels"
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
        key = hashlib.sha256("\n".join([*(src.read_text() for src in SOURCES), torch.__version__, *version, _cpu_flags(),
                                         _march()]).encode())
        folder = _home() / "native" / key.hexdigest()[:16]
        library = folder / "libtokq_native.so"
        if not library.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                built = Path(tmp) / library.name
                try:
                    _build(compiler, built)
                except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                    return f"building tokq's native kernels failed ({exc})"
                os.replace(built, library)  # atomic: a concurrent build of the same key writes the same bytes
        try:
            torch.ops.load_library(str(library))
        except (OSError, RuntimeError) as exc:
            return f"loading {library} failed ({exc})"
    _register_fakes()
    return None


def unavailable() -> str | None:
    """Why the native kernels cannot run here (None: they are loaded). Builds them on the first call."""
    with _lock:
        if "why" not in _state:
            _state["why"] = _load()
        return _state["why"]


def isa() -> str:
    return torch.ops.tokq_native.isa()


def wants_unsigned_int8() -> bool:
    """Whether int8_gemv reads the codes + 128 as unsigned bytes (VNNI builds) rather than the signed codes."""
    return isa().endswith("vnni")


_fakes_done = False


def _register_fakes() -> None:
    global _fakes_done
    if _fakes_done:
        return

    @torch.library.register_fake("tokq_native::int4_gemv")
    def _int4(x, packed, scale, zero, group):
        return x.new_empty((x.shape[0], packed.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("tokq_native::int4_gemv_tiled")
    def _int4_tiled(x, packed, group):
        return x.new_empty((x.shape[0], packed.shape[0] * 16), dtype=torch.float32)

    @torch.library.register_fake("tokq_native::int8_gemv")
    def _int8(x, q, qu, scale):
        return x.new_empty((x.shape[0], q.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("tokq_native::bf16_gemv")
    def _bf16(x, w):
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake("tokq_native::paged_decode")
    def _decode(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window):
        return torch.empty_like(q)

    @torch.library.register_fake("tokq_native::paged_decode_step")
    def _decode_step(q, k, v, k_cache, v_cache, slots, block_tables, seq_lens, query_start_loc, scale, window):
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)

    @torch.library.register_fake("tokq_native::paged_write")
    def _write(k, v, k_cache, v_cache, slots):
        return None

    _fakes_done = True


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Signed int4 codes [N, K] (-8..7, 32 | K) -> gemv.cpp's bytes [N, K/2]: per chunk of 32, byte j holds
    u[j] | u[j + 16] << 4 with u = code + 8."""
    n, k = codes.shape
    u = (codes.to(torch.int16) + 8).to(torch.uint8).view(n, k // 32, 2, 16)
    return (u[:, :, 0, :] | (u[:, :, 1, :] << 4)).reshape(n, k // 2).contiguous()


def pack_int4_tiled(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                    group_size: int) -> torch.Tensor:
    """Signed int4 codes [N, K] (-8..7, 16 | N, 64 | group | K), scales fp32 [N, G] and signed zero codes [N, G]
    (None: symmetric) -> gemv.cpp's tiled bytes [N / 16, G, unit]: per tile of 16 rows and weight group, the group's
    blocks of 64 k (512 bytes each: quad q (k = 64 b + 4 q + i) of row n at [q % 8][n][i], q < 8 in the low nibble,
    q >= 8 in the high one, u = code + 8), then the 16 rows' scales (bf16 when every scale is a bf16 value, else
    fp32), then their offsets zero + 8 (uint8). Dequantized: W = (u - offset) * scale."""
    n, k = codes.shape
    groups = k // group_size
    u = (codes.to(torch.int16) + 8).to(torch.uint8).view(n // 16, 16, k // 64, 16, 4)  # [t, n, b, q, i]
    u = u.permute(0, 2, 3, 1, 4)  # [t, b, q, n, i]
    blocks = (u[:, :, :8] | (u[:, :, 8:] << 4)).reshape(n // 16, groups, (group_size // 64) * 512)
    scale = scale.float()
    as_bf16 = scale.to(torch.bfloat16)
    stored = as_bf16 if torch.equal(as_bf16.float(), scale) else scale  # bf16 only where that is exact
    scale_bytes = stored.view(n // 16, 16, groups).transpose(1, 2).contiguous().view(torch.uint8)
    offsets = torch.full((n, groups), 8, dtype=torch.int16) if zero is None else zero.to(torch.int16) + 8
    if int(offsets.min()) < 0 or int(offsets.max()) > 255:
        raise ValueError("pack_int4_tiled: zero points must lie in [-8, 247]")
    offset_bytes = offsets.to(torch.uint8).view(n // 16, 16, groups).transpose(1, 2)
    return torch.cat([blocks, scale_bytes.view(n // 16, groups, -1), offset_bytes], dim=2).contiguous()
