"""GPTQ for one linear layer (Frantar et al., "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers", arXiv 2210.17323).

Objective: for a linear y = x W^T with calibration inputs X [n, K], find integer weights Q on the
scheme's grid minimising (1/n) ||X W^T - X Q^T||^2 = tr((W - Q) H (W - Q)^T) / 2 with the Hessian
H = (2/n) X^T X (what `HessianAccumulator` collects).

The algorithm, as in the paper:

1. Dead inputs (H_ii == 0: the input was always zero on the calibration set) get H_ii = 1 and
   their weight column set to 0 (they contribute nothing to the objective; 0 lies on every grid).
2. Dampening: lambda = damp * mean(diag H) is added to the diagonal. If H + lambda I is not
   positive definite (too few calibration tokens for the layer's size, or a bad matrix) the damp
   is multiplied by 10 and retried, up to `MAX_DAMP`, with a warning naming the layer; after
   that a `TokqError` says what to do.
3. U = upper Cholesky factor of (H + lambda I)^-1 (cholesky, cholesky_inverse, cholesky upper).
4. Columns are quantized one at a time (optionally in act-order, see below); the rounding error
   of column i, e_i = (w_i - q_i) / U_ii, is spread over the columns not yet quantized by
   subtracting e_i U_i,j. Updates are applied lazily: exactly within a block of `block_size`
   columns, and as one matrix product to the columns after the block once the block is done.
   The lazy form is exact, so the result does not depend on `block_size` (up to fp rounding).

Grids (scale/zero from `int_qparams`, tokq's RTN grid, on each group's range: with `scale_search="mse"`,
the default, the range shrunk by the clip ratio that minimises the group's own rounding error,
`rounding.mse_qparams`, as llm-compressor's `mse` observer does; with "minmax" the full range).
Why the search matters most under act-order's static groups: their grids are fixed from the original
weights before any compensation, so a min/max grid spends its 16 levels on each group's extremes and
leaves GPTQ to make up the coarse rounding of the bulk through the calibration Hessian, a fit to the
calibration text. Calibrated on Python source and judged on prose (benchmarks/calibration_shift.py,
SmolLM2 int4 g64) GPTQ kept a 28% KL reduction over RTN with min/max grids and 49% with searched ones.

- per-channel: one grid per output row, computed up front from the (dead-zeroed) weights.
- per-group, act_order=False: the standard GPTQ choice. A group's grid is computed when the
  column loop reaches the group's first column, from that group's *current* weights (already
  updated by the errors of earlier columns, including the pending lazy updates when a group
  straddles a block boundary). `static_groups` has no effect here.
- per-group, act_order=True: columns are processed in order of decreasing H_ii (the inputs with
  the most energy first, while there is most freedom left to compensate). Only static groups are
  supported (the default): every original group's grid is computed up front from the original
  weights and each column uses its original group's grid. The stored codes therefore stay in the
  original column order with group-contiguous groups (g_idx = k // group_size), the layout that
  `quantize_rtn` returns and every kernel reads; no g_idx / permutation needs to be stored.
  (Dynamic grids under act-order would need a g_idx layout, which tokq does not ship, so
  act_order=True with static_groups=False raises a ConfigError.)

Reported numbers (`GPTQResult`):

- `loss` = sum_i ||e_i||^2 = sum over columns of (w - q)^2 / U_ii^2, the paper's objective as the
  algorithm accumulates it. Since W - Q = E U and U H_damped U^T = I, it equals
  tr((W' - Q) H_damped (W' - Q)^T) exactly (W' = W with dead columns zeroed, H_damped the
  dampened Hessian the algorithm used), summed over all N rows (not divided by N) and without
  the paper's factor 1/2.
- `proxy_error` = tr((W - Q) H (W - Q)^T) / N with the original W and undamped H: the mean output
  error per row, (2/n) ||X W^T - X Q^T||^2 / N. Compute the same for RTN to compare.

All math is fp32 on the device of `w` (the Hessian is moved there); CPU and CUDA both work.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tokq.errors import ConfigError, TokqError
from tokq.kernels.reference import IntWeight
from tokq.quantization.rounding import check_finite, int_qparams, mse_qparams
from tokq.quantization.scheme import CHANNEL, WeightArgs

log = logging.getLogger("tokq")

MAX_DAMP = 1.0  # the largest damp the retry loop tries (a larger --damp is still tried once)
SCALE_SEARCHES = ("mse", "minmax")  # how a grid's range is chosen (see "Grids" in the module doc)


class HessianAccumulator:
    """Collects H = (2/n) sum_t x_t x_t^T over the calibration tokens x_t [K] of one linear.

    `add(x)` takes inputs of any leading shape [..., K] (e.g. [batch, seq, K]); every row is one
    token. Each batch's x^T x is computed in fp32 on x's device and accumulated in float64, so
    many batches do not lose precision. Memory is O(K^2), independent of the number of tokens.
    """

    BAND_BYTES = 64 * 2**20

    def __init__(self, in_features: int):
        self.in_features = int(in_features)
        self._sum: torch.Tensor | None = None  # float64 [K, K], sum of x x^T
        self._n = 0

    def add(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"HessianAccumulator expects inputs [..., {self.in_features}], got {tuple(x.shape)}")
        x = x.detach().reshape(-1, self.in_features).float()
        if x.shape[0] == 0:
            return
        if self._sum is None:
            self._sum = torch.zeros(self.in_features, self.in_features, dtype=torch.float64, device=x.device)
        # x^T x a band of columns at a time, each added in place into the float64 sum (widened as it is read):
        # at K = 8960 the whole fp32 product would be 321 MB beside the 642 MB sum, a band is at most 64 MB
        xt = x.t()
        step = max(1, self.BAND_BYTES // (4 * self.in_features))
        for j in range(0, self.in_features, step):
            self._sum[:, j : j + step].add_((xt @ x[:, j : j + step]).to(self._sum.device))
        self._n += x.shape[0]

    @property
    def n_samples(self) -> int:
        """Tokens (rows of x) seen so far."""
        return self._n

    @property
    def hessian(self) -> torch.Tensor:
        """(2/n) X^T X as fp32 [K, K], on the device of the first batch."""
        if self._sum is None or self._n == 0:
            raise TokqError("no calibration tokens reached this layer: its GPTQ Hessian is empty; "
                            "check the calibration data (--calib)")
        return (self._sum * (2.0 / self._n)).float()

    def take_hessian(self) -> torch.Tensor:
        """`hessian`, computed in the sum's own memory, which is released: the accumulator is spent. The same values
        as `hessian` without its float64 temporary beside the sum (at K = 8960: 642 MB less at the peak)."""
        if self._sum is None or self._n == 0:
            return self.hessian  # raises the empty-Hessian error
        total, self._sum = self._sum, None
        with torch.inference_mode():  # the sum was made in the calibration forward's inference mode
            total.mul_(2.0 / self._n)
        return total.float()  # out of place, outside inference mode: a normal tensor the solver may edit


@dataclass
class GPTQResult:
    weight: IntWeight  # same layout as quantize_rtn: codes in original column order, group-contiguous
    loss: float  # sum of err^2 / d^2 = tr((W'-Q) H_damped (W'-Q)^T), summed over rows (see module doc)
    proxy_error: float  # tr((W-Q) H (W-Q)^T) / N with the original W and undamped H
    damp_used: float  # the damp that gave a positive-definite Hessian (>= the requested one)
    seconds: float  # wall time of gptq_quantize


def _damp_schedule(damp: float) -> list[float]:
    damps = [damp]
    while damps[-1] * 10 <= MAX_DAMP * (1 + 1e-9):
        damps.append(damps[-1] * 10)
    return damps


def _inverse_cholesky(h: torch.Tensor, damp: float, layer: str) -> tuple[torch.Tensor, float]:
    """(U, damp used): U upper Cholesky factor of (H + damp * mean(diag H) I)^-1.

    The damp goes onto h's own diagonal and the diagonal is put back exactly before returning: no copy of a
    [K, K] matrix beyond the factor, its inverse and U, one after the other (at K = 8960, a 1.5B model's down
    projection, each is 321 MB)."""
    diag = h.diagonal().clone()
    mean_diag = diag.mean()
    tried = []
    try:
        for d in _damp_schedule(damp):
            h.diagonal().copy_(diag + d * mean_diag)
            chol, info = torch.linalg.cholesky_ex(h)
            if int(info) == 0:
                inverse = torch.cholesky_inverse(chol)
                del chol
                u, info = torch.linalg.cholesky_ex(inverse, upper=True)
                del inverse
                if int(info) == 0 and bool(torch.isfinite(u).all()):
                    return u, d
                del u
            else:
                del chol
            tried.append(d)
            log.warning("GPTQ %s: Hessian is not positive definite with damp %g; retrying with a larger damp",
                        layer or "layer", d)
    finally:
        h.diagonal().copy_(diag)
    raise TokqError(
        f"GPTQ failed for {layer or 'a layer'}: its Hessian is not positive definite even with damp "
        f"{tried[-1]:g}; calibrate on more data (many more tokens than its {h.shape[0]} inputs) "
        "or pass a larger --damp"
    )


def _round(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, args: WeightArgs):
    """Codes and their dequantized values, exactly as quantize_with / IntWeight.dequantize compute them."""
    if zero is None:
        code = torch.round(w / scale).clamp(args.qmin, args.qmax)
        return code, code * scale
    z = zero.float()
    code = torch.round(w / scale + z).clamp(args.qmin, args.qmax)
    return code, (code - z) * scale


@contextmanager
def _one_cpu_thread(device: torch.device) -> Iterator[None]:
    """Run on one CPU thread. GPTQ's column loop is thousands of small ops; with two OpenMP threads
    on a shared machine each op can wait milliseconds for a descheduled partner thread (measured
    here under load: torch.round on 3K floats 21.6 ms at 2 threads vs 0.006 ms at 1, a 1536x1536
    cholesky_inverse 7.5 s vs 0.14 s), while one thread loses little on work this small."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def gptq_quantize(
    w: torch.Tensor,
    hessian: torch.Tensor | HessianAccumulator,
    args: WeightArgs,
    act_order: bool = False,
    damp: float = 0.01,
    block_size: int = 128,
    static_groups: bool = True,
    layer_name: str = "",
    scale_search: str = "mse",
) -> GPTQResult:
    """Quantize w [N, K] with GPTQ against the Hessian [K, K] of its inputs (see the module doc). Given the
    accumulator itself, the solver takes its Hessian and holds the only reference to it, so with act-order it can
    drop it once permuted: one [K, K] matrix fewer at the peak."""
    with _one_cpu_thread(w.device):
        return _gptq_quantize(w, hessian, args, act_order, damp, block_size, static_groups, layer_name, scale_search)


def _gptq_quantize(
    w: torch.Tensor,
    hessian: torch.Tensor | HessianAccumulator,
    args: WeightArgs,
    act_order: bool,
    damp: float,
    block_size: int,
    static_groups: bool,
    layer_name: str,
    scale_search: str = "mse",
) -> GPTQResult:
    start = time.perf_counter()
    layer = layer_name or "layer"
    if isinstance(hessian, HessianAccumulator):
        hessian = hessian.take_hessian()
    if w.dim() != 2:
        raise ValueError(f"gptq_quantize expects a 2-D weight [N, K], got {tuple(w.shape)}")
    n, k = w.shape
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"{layer}: Hessian shape {tuple(hessian.shape)} does not match the weight's {k} inputs")
    if args.kind != "int":
        raise ConfigError(f"GPTQ quantizes to integer grids; {layer}'s scheme has {args.kind} weights (use rtn)")
    if act_order and args.strategy != CHANNEL and not static_groups:
        raise ConfigError("act-order GPTQ needs static groups in tokq (dynamic act-order groups need a g_idx "
                          "layout that tokq does not write)")
    if scale_search not in SCALE_SEARCHES:
        raise ConfigError(f"GPTQ scale search must be one of {', '.join(SCALE_SEARCHES)}, got {scale_search!r}")
    if damp <= 0:
        raise ConfigError(f"GPTQ damp must be positive, got {damp}")
    if block_size < 1:
        raise ConfigError(f"GPTQ block size must be positive, got {block_size}")
    args.check_divides(k, layer)
    check_finite(w, "weight", layer)
    check_finite(hessian, "GPTQ Hessian (calibration inputs)", layer)

    device = w.device
    w_orig = w.detach().float()
    # The given (or taken) tensor itself when it is fp32 on this device: without act-order the solver works on it
    # in place (its diagonal put back exactly, so the proxy error reads it undamped at the end); with act-order its
    # permuted copy replaces it. Either way a large layer's Hessian is held once, not twice.
    h_orig = hessian.detach().to(device=device, dtype=torch.float32)
    W = w_orig.clone()

    dead = h_orig.diagonal() == 0
    W[:, dead] = 0.0

    per_channel = args.strategy == CHANNEL
    gs = k if per_channel else args.group_size
    groups = args.groups_for(k)
    dynamic = not per_channel and not act_order
    if dynamic:
        scale = torch.empty(n, groups, device=device)
        zero = None if args.symmetric else torch.empty(n, groups, dtype=torch.int8, device=device)

    def grid(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return int_qparams(weights, args) if scale_search == "minmax" else mse_qparams(weights, args)

    if not dynamic:
        scale, zero = grid(W)  # per channel: [N, 1]; static groups: [N, G]

    if act_order:
        key = h_orig.diagonal().clone()
        key[dead] = 1.0
        perm = torch.sort(key, descending=True, stable=True).indices
        W = W[:, perm]
        rows = h_orig.index_select(0, perm)
        H = rows.index_select(1, perm)
        del rows, h_orig, hessian  # the permuted copy serves the rest, the proxy error included (read in its order)
        dead_here = dead[perm]
        group_of = (perm // gs).tolist()
    else:
        perm = None
        H = h_orig
        dead_here = dead
        group_of = [c // gs for c in range(k)]

    H.diagonal()[dead_here] = 1.0  # a column no input reaches: any positive value keeps H invertible
    try:
        U, damp_used = _inverse_cholesky(H, damp, layer)
    finally:
        H.diagonal()[dead_here] = 0.0  # (h_orig's own diagonal when H is h_orig: exactly as it came)

    codes = torch.empty(n, k, device=device)
    deq = torch.empty(n, k, device=device)
    loss = torch.zeros((), dtype=torch.float64, device=device)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = W[:, i1:i2].clone()
        E1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            g = group_of[col]
            if dynamic and col % gs == 0:
                # The group's current weights: updated within the block, plus the block's pending
                # (lazy) updates for columns past its end when the group straddles the boundary.
                end = col + gs
                cur = W1[:, i : min(end, i2) - i1]
                if end > i2:
                    rest = W[:, i2:end] - E1[:, :i] @ U[i1:col, i2:end]
                    cur = torch.cat([cur, rest], dim=1)
                s, z = grid(cur)
                scale[:, g] = s[:, 0]
                if zero is not None:
                    zero[:, g] = z[:, 0]
            wc = W1[:, i]
            code, q = _round(wc, scale[:, g], None if zero is None else zero[:, g], args)
            codes[:, col] = code
            deq[:, col] = q
            err = (wc - q) / U1[i, i]
            E1[:, i] = err
            if i + 1 < i2 - i1:
                W1[:, i + 1 :].addr_(err, U1[i, i + 1 :], alpha=-1.0)
        loss += E1.double().pow(2).sum()
        if i2 < k:
            W[:, i2:].addmm_(E1, U[i1:i2, i2:], alpha=-1.0)

    # tr((W - Q) H (W - Q)^T) is the same in any consistent order of the inputs: read in H's
    delta = (w_orig if perm is None else w_orig[:, perm]) - deq
    proxy = float(((delta @ H) * delta).sum().double()) / n
    del H, delta, deq
    if perm is not None:
        codes = codes[:, torch.argsort(perm)]
    weight = IntWeight(codes.to(torch.int8), scale.float(), zero, args.bits, gs)
    loss_value = float(loss)
    if not math.isfinite(loss_value) or not math.isfinite(proxy):
        raise TokqError(f"GPTQ produced non-finite errors for {layer}; pass a larger --damp")
    return GPTQResult(weight, loss_value, proxy, damp_used, time.perf_counter() - start)
