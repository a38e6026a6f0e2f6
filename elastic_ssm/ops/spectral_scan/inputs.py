"""The inputs of the ESSH scan (Eq. 5, 9, 24; C.3): ``ModalTables`` (the five per-mode tables) and their checks."""

from __future__ import annotations

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
