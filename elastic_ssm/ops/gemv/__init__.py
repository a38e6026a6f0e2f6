"""The decode step's row kernels (ESSH paper Appendix O.3: decoding streams weights): fused small-batch weight
products and the RMSNorm and SwiGLU of decode rows::

    norm_gemv(x, w, g)          y = W (g * x / rms(x))           W [N, D] rows   (pre-norm + projection)
    norm_swiglu_gemv(x, w, g)   a = silu(W_g u) * (W_u u)        W [2F, D] rows (gate_f, up_f), u normed
    gemv_accumulate(a, w, x)    x += scale * a W                 W [N, D] in x out (down / out projection)
    rms_norm(x, weight, eps)    y = weight * x / sqrt(mean_j x_j^2 + eps)          x [B, D] -> [B, D]
    swiglu(h)                   y_j = silu(h_{2j}) * h_{2j+1}                      h [B, 2n] -> [B, n]

x [B, D]; products accumulate in float32 (float64 operands keep float64 on the torch path). ``backend="torch"``
is the reference; ``"triton"`` runs ``triton_kernels.py``: the products for ``B <= MAX_FUSED_BATCH``, the norm and
SwiGLU for 2-D inputs that are not float64.

Programmatic dependent launch (PDL) of every decode kernel (CUDA, Hopper and newer; PTX ``griddepcontrol``): rules
every PDL kernel follows: ``gdc_launch_dependents`` at the program's start; before ``gdc_wait`` only reads of memory
no kernel of the step writes (weights, constant tables); ``gdc_wait`` once per program before its first activation
read and any store. Kernels take a ``PDL: tl.constexpr`` flag (False: CPU interpreter, older GPUs,
``ELASTIC_SSM_PDL=0``; ``pdl_enter`` of ``triton_kernels.py``); launches pass ``**launch_options(pdl)``."""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from ...utils.environment import env_flag
from ..dispatch import pow2, resolve_decode_backend, triton_interpreting

__all__ = ["MAX_FUSED_BATCH", "norm_gemv", "norm_swiglu_gemv", "gemv_accumulate", "rms_norm", "swiglu",
           "pdl_supported", "resolve_pdl", "launch_options"]

MAX_FUSED_BATCH = 8


def pdl_supported(device: torch.device | str) -> bool:
    """True on a CUDA device of compute capability >= 9.0, outside the Triton interpreter, unless the
    environment sets ``ELASTIC_SSM_PDL=0``."""
    device = torch.device(device)
    off = "ELASTIC_SSM_PDL" in os.environ and not env_flag("ELASTIC_SSM_PDL")    # 0 / false / off; garbage: one line
    if device.type != "cuda" or triton_interpreting() or off:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def resolve_pdl(pdl: bool | str, device: torch.device | str) -> bool:
    """``pdl``: True / False, or 'auto' (= :func:`pdl_supported`). True on an unsupported device raises."""
    if pdl == "auto":
        return pdl_supported(device)
    if pdl not in (True, False):
        raise ValueError(f"pdl must be True, False or 'auto', got {pdl!r}")
    if pdl and not pdl_supported(device):
        raise ValueError("pdl=True needs a CUDA device of compute capability >= 9.0 (Hopper) outside the "
                         "Triton interpreter and ELASTIC_SSM_PDL unset or 1; use pdl='auto' or False")
    return bool(pdl)


def launch_options(pdl: bool) -> dict:
    """Keywords of a Triton launch: ``launch_pdl=True`` when ``pdl`` (an ordinary launch otherwise)."""
    return {"launch_pdl": True} if pdl else {}



def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check(x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{what}: need x [B, D] and w [N, D] with the same D, got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if w.stride(1) != 1:
        raise ValueError(f"{what}: w must have unit stride along D (a row-major weight or a row prefix)")


def _wide(*ts: torch.Tensor) -> torch.dtype:
    """The arithmetic dtype of the torch path: float32, or float64 when an operand is float64."""
    return functools.reduce(torch.promote_types, (t.dtype for t in ts), torch.float32)


def _normed(x: torch.Tensor, g: torch.Tensor | None, eps: float, dt: torch.dtype) -> torch.Tensor:
    xf = x.to(dt)
    return xf if g is None else F.rms_norm(xf, (xf.shape[-1],), g.to(dt), eps)


def _use_triton(backend: str, x: torch.Tensor, *ts: torch.Tensor) -> bool:
    return (resolve_decode_backend(backend, x.device) == "triton" and x.shape[0] <= MAX_FUSED_BATCH
            and _wide(x, *ts) == torch.float32)


def _rows(x, w, g, y, eps, swiglu: bool, residual: bool, n_out: int, block_n: int | None,
          block_k: int | None, num_warps: int | None, pdl: bool = False) -> None:
    """Launch ``rows_gemv_kernel``. Default tile: 4 outputs x min(D, 1024 / batch block) columns, 4 warps (the
    fastest swept on an H200). With ``pdl`` at batch 1 one tile spans all of D (the whole weight slab is read
    before ``gdc_wait``), with as many outputs per program as keep the slab at 8192 elements."""
    from .triton_kernels import rows_gemv_kernel

    B, D = x.shape
    bb = pow2(B)
    per_unit = 2 if swiglu else 1                       # weight rows per output
    if pdl and bb == 1 and block_k is None:
        bk = pow2(D)
        bn = block_n or max(1, min(4, 8192 // (bk * per_unit)))
    else:
        bn, bk = block_n or 4, block_k or max(32, min(pow2(D), 1024 // bb))
    rows_gemv_kernel[(_cdiv(n_out, bn),)](x, g if g is not None else x, w, y, B, n_out, D, x.stride(0),
                                          w.stride(0), y.stride(0), eps, HAS_NORM=g is not None, SWIGLU=swiglu,
                                          RESIDUAL=residual, BLOCK_B=bb, BLOCK_N=bn, BLOCK_K=bk, PDL=pdl,
                                          num_warps=num_warps or 4, **launch_options(pdl))


def norm_gemv(x: torch.Tensor, w: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
              out: torch.Tensor | None = None, residual: bool = False, out_dtype: torch.dtype | None = None,
              backend: str = "auto", block_n: int | None = None, block_k: int | None = None,
              num_warps: int | None = None, pdl: bool = False) -> torch.Tensor:
    """``y [B, N] = rmsnorm(x; norm_weight) @ w.T`` (no norm when ``norm_weight`` is None); x [B, D], w [N, D].
    ``residual=True`` adds the product into ``out`` (not ``x``) in place. ``pdl`` (module docstring; all three ops)
    is ignored on the torch path."""
    _check(x, w, "norm_gemv")
    B, N = x.shape[0], w.shape[0]
    if residual and (out is None or out.data_ptr() == x.data_ptr()):
        raise ValueError("norm_gemv(residual=True) adds into `out`, which must be given and differ from x")
    if out is None:
        out = torch.empty(B, N, dtype=out_dtype or _wide(x, w), device=x.device)
    if _use_triton(backend, x, w):
        _rows(x if x.stride(1) == 1 else x.contiguous(), w, norm_weight, out, eps, False, residual, N,
              block_n, block_k, num_warps, pdl)
        return out
    dt = _wide(x, w)
    y = _normed(x, norm_weight, eps, dt) @ w.to(dt).t()
    return out.add_(y.to(out.dtype)) if residual else out.copy_(y)


def norm_swiglu_gemv(x: torch.Tensor, w: torch.Tensor, norm_weight: torch.Tensor | None = None,
                     eps: float = 1e-6, out_dtype: torch.dtype | None = None, backend: str = "auto",
                     block_n: int | None = None, block_k: int | None = None,
                     num_warps: int | None = None, pdl: bool = False) -> torch.Tensor:
    """``a [B, F] = silu(u W_g^T) * (u W_u^T)``, u = rmsnorm(x), w [2F, D] with rows (gate_f, up_f) at
    (2f, 2f+1) — the row layout of ``SwiGLU.w_in.weight`` ``[2F, D]`` (a prefix of F units)."""
    _check(x, w, "norm_swiglu_gemv")
    if w.shape[0] % 2:
        raise ValueError(f"norm_swiglu_gemv: w must have an even number of rows (gate, up pairs), got {w.shape[0]}")
    B, F2 = x.shape[0], w.shape[0] // 2
    dt = _wide(x, w)
    if _use_triton(backend, x, w):
        out = torch.empty(B, F2, dtype=out_dtype or dt, device=x.device)
        _rows(x if x.stride(1) == 1 else x.contiguous(), w, norm_weight, out, eps, True, False, F2, block_n,
              block_k, num_warps, pdl)
        return out
    h = (_normed(x, norm_weight, eps, dt) @ w.to(dt).t()).unflatten(-1, (F2, 2))
    return (F.silu(h[..., 0]) * h[..., 1]).to(out_dtype or dt)


def gemv_accumulate(a: torch.Tensor, w: torch.Tensor, x: torch.Tensor, scale: float = 1.0,
                    backend: str = "auto", block_n: int | None = None, block_d: int | None = None,
                    split: int | None = None, num_warps: int | None = None, pdl: bool = False) -> torch.Tensor:
    """``x += scale * a @ w`` in place: a [B, N], w [N, D] (input x output, unit stride along D), x [B, D]
    contiguous, float32 (or float64 on the torch path). Returns x. The Triton path splits N across
    programs and adds with atomics."""
    if a.dim() != 2 or w.dim() != 2 or x.dim() != 2 or a.shape[1] != w.shape[0] or x.shape != (a.shape[0], w.shape[1]):
        raise ValueError(f"gemv_accumulate: need a [B, N], w [N, D], x [B, D]; got {tuple(a.shape)}, "
                         f"{tuple(w.shape)}, {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float64) or not x.is_contiguous():
        raise ValueError("gemv_accumulate: x (the residual stream) must be a contiguous float32/64 tensor")
    B, N = a.shape
    D = w.shape[1]
    if not _use_triton(backend, a, w, x) or w.stride(1) != 1:
        dt = _wide(a, w, x)
        x.add_((scale * (a.to(dt) @ w.to(dt))).to(x.dtype))
        return x
    from .triton_kernels import cols_gemv_kernel

    a = a if a.stride(1) == 1 else a.contiguous()
    bb = pow2(B)
    bd = block_d or 64
    bn = block_n or max(8, 64 // bb)
    n_col = _cdiv(D, bd)
    if split is None:   # ~2 programs per SM, each at least one row tile
        sms = torch.cuda.get_device_properties(a.device).multi_processor_count if a.device.type == "cuda" else 8
        split = max(1, min(_cdiv(N, bn), _cdiv(2 * sms, n_col)))
    rows = _cdiv(_cdiv(N, split), bn) * bn          # rows per split, a whole number of row tiles
    split = _cdiv(N, rows)
    cols_gemv_kernel[(n_col, split)](a, w, x, B, N, D, a.stride(0), w.stride(0), x.stride(0),
                                     float(scale), ROWS=rows, BLOCK_B=bb, BLOCK_N=bn, BLOCK_D=bd, PDL=pdl,
                                     num_warps=num_warps or 4, **launch_options(pdl))
    return x


def _rows_on_triton(x: torch.Tensor, backend: str) -> bool:
    return resolve_decode_backend(backend, x.device) == "triton" and x.dtype != torch.float64 and x.dim() == 2


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    """RMSNorm of rows ``x [B, D]`` (the torch path: any ``[..., D]``) with ``weight [D]`` (float32 arithmetic for
    half inputs, output in ``x.dtype``)."""
    if not _rows_on_triton(x, backend):
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        return F.rms_norm(xf, (xf.shape[-1],), weight.to(xf.dtype), eps).to(x.dtype)
    from .triton_kernels import rms_norm_kernel

    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty_like(x)
    B, D = x.shape
    rms_norm_kernel[(B,)](x, weight, y, D, x.stride(0), y.stride(0), eps, BLOCK_D=pow2(D, 16),
                          num_warps=4 if D <= 2048 else 8)
    return y


def swiglu(h: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``silu(gate) * up`` of interleaved pairs: ``h [B, 2n]``, ``(gate_j, up_j)`` at ``(2j, 2j+1)`` -> ``[B, n]``."""
    if not _rows_on_triton(h, backend):
        g = h.unflatten(-1, (-1, 2))  # [B, n, 2] (gate, up) pairs
        return F.silu(g[..., 0]) * g[..., 1]
    from .triton_kernels import swiglu_kernel

    h = h if h.stride(-1) == 1 else h.contiguous()
    B, N = h.shape[0], h.shape[1] // 2
    y = torch.empty(B, N, dtype=h.dtype, device=h.device)
    block = 1024
    swiglu_kernel[(B, -(-N // block))](h, y, N, h.stride(0), y.stride(0), BLOCK_N=block, num_warps=4)
    return y
