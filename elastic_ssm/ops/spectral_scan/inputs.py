"""The inputs of the ESSH scan (Eq. 5, 9, 24; C.3): ``ModalTables`` (the five per-mode tables), their checks, and the
edge values shared by the chunked paths: exact resets (a capped log-decay), non-finite inputs isolated where the
float64 spec (``naive.py``) puts them, value ranges checked (README.md, "Edge values")."""

from __future__ import annotations

import contextvars
import math
from contextlib import contextmanager
from typing import NamedTuple

import torch


class ModalTables(NamedTuple):
    """The fixed modal tables of one spectral layer at one tier, each ``[K, M]``; a NamedTuple, so ``*tables``
    fills the public signature and ``torch.compile`` traces it as a plain tuple."""

    rho: torch.Tensor  # [K, M] intrinsic decay in [0, 1] (rho = exp(-softplus(rho_raw)), C.3)
    theta: torch.Tensor  # [K, M] rotation frequency (Eq. 9)
    kc: torch.Tensor  # [K, M] readout cosine coefficient (kappa = (kc, -ks))
    ks: torch.Tensor  # [K, M] readout sine coefficient
    a: torch.Tensor  # [K, M] zero-lag correction coefficient (Eq. 24)

    def to(self, dtype: torch.dtype) -> ModalTables:
        """All five tables in ``dtype``."""
        return ModalTables(*(t.to(dtype) for t in self))


def _shape(x) -> str:
    return str(list(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def validate_scan_inputs(v, write, read, clock, modal: ModalTables, initial_state=None, step: bool = False) -> None:
    """A ValueError naming the argument unless ``v [B, T, K, P]``, ``write, read, clock [B, T, K, M]``, every
    table ``[K, M]`` and ``initial_state [B, K, M, 2, P]`` (or None) are floating tensors on one device. ``step``:
    the one-token inputs of ``spectral_scan_step`` (``v_t [B, K, P]``, ``write_t, read_t, clock_t [B, K, M]``, a
    required ``state [B, K, M, 2, P]``)."""
    op, bt = ("spectral_scan_step", "B") if step else ("spectral_scan", "B, T")
    nv, nw, nr, nc = (n + "_t" * step for n in ("v", "write", "read", "clock"))
    ns = "state" if step else "initial_state"
    if not isinstance(v, torch.Tensor) or v.dim() != 4 - step:
        raise ValueError(f"{op}: {nv} must be a [{bt}, K, P] tensor, got {_shape(v)}")
    *lead, P = v.shape  # lead: [B, T, K] or [B, K]
    B, K = lead[0], lead[-1]
    if not isinstance(write, torch.Tensor) or write.dim() != v.dim() or list(write.shape[:-1]) != lead:
        raise ValueError(f"{op}: {nw} must be [{bt}, K, M] = [{', '.join(map(str, lead))}, M] to match {nv}, "
                         f"got {_shape(write)}")
    M = write.shape[-1]
    for x in (read, clock):
        if not isinstance(x, torch.Tensor) or list(x.shape) != [*lead, M]:
            raise ValueError(f"{op}: {nw}, {nr} and {nc} must share one shape [{bt}, K, M] with {bt}, K of {nv}; "
                             f"got {nw} {_shape(write)}, {nr} {_shape(read)}, {nc} {_shape(clock)}")
    params = modal._asdict()
    for name, x in params.items():
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != (K, M):
            raise ValueError(f"{op}: {name} must be [K, M] = [{K}, {M}] (channels of {nv}, modes of {nw}), "
                             f"got {_shape(x)}")
    tensors = {nv: v, nw: write, nr: read, nc: clock, **params}
    if initial_state is not None or step:
        if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != (B, K, M, 2, P):
            raise ValueError(f"{op}: {ns} must be [B, K, M, 2, P] = [{B}, {K}, {M}, 2, {P}], "
                             f"got {_shape(initial_state)}")
        tensors[ns] = initial_state
    bad = [n for n, x in tensors.items() if not x.is_floating_point()]
    if bad:
        raise ValueError(f"{op}: {', '.join(bad)} must be floating point tensors")
    devices = {n: str(x.device) for n, x in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"{op}: all inputs must be on one device, got {devices}")


def reset_exponent(dtype: torch.dtype) -> float:
    """A log-decay from which ``exp(-x)`` is exactly 0 in ``dtype`` (about 105.3 in fp32, 746.5 in fp64), where
    larger per-position log-decays are capped without changing any result."""
    return -math.log(torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps) + 2.0


def capped_log_decay(clock: torch.Tensor, rho: torch.Tensor, dtype: torch.dtype, cap_of: torch.dtype) -> torch.Tensor:
    """``min(Delta - log rho, reset_exponent(cap_of))`` in ``dtype``: ``clock [B, T, K, M]``, ``rho [K, M]`` ->
    ``[B, T, K, M]``; ``rho = 0`` or an infinite clock gives the cap with a zero gradient, as in the spec."""
    rho = rho.to(dtype)
    zero = rho == 0  # NaN or negative rho stay NaN (loud), only an exact 0 is the reset
    log_rho = torch.where(zero, -math.inf, torch.log(torch.where(zero, 1.0, rho)))  # the inner where: no 1/0
    return (clock.to(dtype) - log_rho).clamp(max=reset_exponent(cap_of))


_SYNC_FREE = contextvars.ContextVar("elastic_ssm_sync_free", default=False)


@contextmanager
def sync_free():
    """Scans in this block (this thread) skip ``isolate_nonfinite`` and its host sync, as compiled and captured
    ones do (a NaN input then spoils its own row's chunk; README.md, "Edge values")."""
    token = _SYNC_FREE.set(True)
    try:
        yield
    finally:
        _SYNC_FREE.reset(token)


def host_sync_allowed(x: torch.Tensor) -> bool:
    """True outside ``torch.compile`` tracing and outside CUDA-graph capture (where ``bool(tensor)`` fails)."""
    return not (torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing()))


def isolating(x: torch.Tensor) -> bool:
    """Whether a scan of ``x`` runs ``isolate_nonfinite``: where a host sync is allowed, outside ``sync_free``."""
    return host_sync_allowed(x) and not _SYNC_FREE.get()


def validate_scan_values(clock: torch.Tensor, modal: ModalTables) -> None:
    """ValueError unless ``clock >= 0`` (NaN propagates as in the spec), ``0 <= rho <= 1`` and ``theta, kc, ks,
    a`` are finite; one host sync (call it where :func:`host_sync_allowed`)."""
    rho = modal.rho
    tables = (("theta", modal.theta), ("kc", modal.kc), ("ks", modal.ks), ("a", modal.a))
    flags = torch.stack([(clock < 0).any(), ~((rho >= 0) & (rho <= 1)).all()]
                        + [~torch.isfinite(x).all() for _, x in tables]).tolist()
    if flags[0]:
        raise ValueError(f"spectral_scan: clock must be >= 0 (a decay), got a minimum of {float(clock.min()):.4g}")
    if flags[1]:
        raise ValueError("spectral_scan: rho must lie in [0, 1] (a decay factor), got values in "
                         f"[{float(rho.min()):.4g}, {float(rho.max()):.4g}] or NaN")
    for (name, _), bad in zip(tables, flags[2:]):
        if bad:
            raise ValueError(f"spectral_scan: {name} must be finite, it holds NaN or Inf")


def poison_out_of_range(clock: torch.Tensor, modal: ModalTables) -> tuple[torch.Tensor, ModalTables]:
    """The sync-free stand-in of :func:`validate_scan_values` for compiled regions: a negative clock and a
    ``rho`` outside ``[0, 1]`` become NaN (in-range values pass unchanged, bit for bit)."""
    clock = torch.where(clock < 0, math.nan, clock)
    rho = torch.where((modal.rho >= 0) & (modal.rho <= 1), modal.rho, math.nan)
    return clock, modal._replace(rho=rho)


def isolate_nonfinite(v, write, read, clock, initial_state):
    """Zero the non-finite entries of ``v [B, T, K, P]``, ``write, read, clock [B, T, K, M]`` and
    ``initial_state [B, K, M, 2, P]`` (or None), and say where the spec's outputs are non-finite (README.md,
    "Edge values"; a ``+inf`` clock is a reset, left to the cap). Returns the cleaned inputs, ``z_bad [B, T, K,
    P]`` and ``state_bad [B, K, M, 1, P]`` (None when all is finite). One host sync (the inputs' sum)."""
    total = v.sum() + write.sum() + read.sum() + clock.sum()  # finite sums: the usual case, one cheap pass
    if initial_state is not None:
        total = total + initial_state.sum()
    if bool(torch.isfinite(total)):
        return v, write, read, clock, initial_state, None, None
    bad_v = ~torch.isfinite(v)  # [B, T, K, P]
    bad_m = ~torch.isfinite(write) | torch.isnan(clock) | (clock == -math.inf)  # [B, T, K, M]
    bad_r = ~torch.isfinite(read)
    bad_h = None if initial_state is None else ~torch.isfinite(initial_state).all(-2)  # [B, K, M, P]
    flags = [bad_v.any(), bad_m.any(), bad_r.any()] + ([] if bad_h is None else [bad_h.any()])
    if not bool(torch.stack(flags).any()):
        return v, write, read, clock, initial_state, None, None

    def from_first(x: torch.Tensor) -> torch.Tensor:  # True from the first True on, along time
        return x.to(torch.uint8).cummax(1).values.bool()

    carried_v, carried_m = from_first(bad_v), from_first(bad_m)
    z_bad = carried_v | (carried_m | bad_r).any(-1, keepdim=True)  # [B, T, K, P]
    state_bad = carried_v[:, -1, :, None, None, :] | carried_m[:, -1, :, :, None, None]  # [B, K, M, 1, P]
    if bad_h is not None:
        z_bad = z_bad | bad_h.any(2)[:, None]
        state_bad = state_bad | bad_h[:, :, :, None, :]
        initial_state = torch.where(bad_h[:, :, :, None, :], 0, initial_state)
    v = torch.where(bad_v, 0, v)
    write = torch.where(bad_m, 0, write)
    read = torch.where(bad_r, 0, read)
    clock = torch.where(torch.isnan(clock) | (clock == -math.inf), 0, clock)
    return v, write, read, clock, initial_state, z_bad, state_bad


def restore_nonfinite(z: torch.Tensor, state: torch.Tensor | None, z_bad: torch.Tensor | None,
                      state_bad: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """NaN where :func:`isolate_nonfinite` found the spec's outputs non-finite: ``z [B, T, K, P]`` and the final
    state ``[B, K, M, 2, P]`` (or None). Gradients of the masked entries are zero."""
    if z_bad is not None:
        z = z.masked_fill(z_bad, math.nan)
    if state is not None and state_bad is not None:
        state = state.masked_fill(state_bad, math.nan)
    return z, state
