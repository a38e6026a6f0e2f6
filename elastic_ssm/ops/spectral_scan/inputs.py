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


def validate_scan_inputs(v, write, read, clock, modal: ModalTables, initial_state=None) -> None:
    """A ValueError naming the argument unless ``v [B, T, K, P]``, ``write, read, clock [B, T, K, M]``, every
    table ``[K, M]`` and ``initial_state [B, K, M, 2, P]`` (or None) are floating tensors on one device."""
    if not isinstance(v, torch.Tensor) or v.dim() != 4:
        raise ValueError(f"spectral_scan: v must be a [B, T, K, P] tensor, got {_shape(v)}")
    B, T, K, P = v.shape
    if not isinstance(write, torch.Tensor) or write.dim() != 4 or tuple(write.shape[:3]) != (B, T, K):
        raise ValueError(f"spectral_scan: write must be [B, T, K, M] = [{B}, {T}, {K}, M] to match v, "
                         f"got {_shape(write)}")
    M = write.shape[-1]
    gates = {"read": read, "clock": clock}
    params = modal._asdict()
    for x in gates.values():
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != (B, T, K, M):
            raise ValueError(f"spectral_scan: write, read and clock must share one shape [B, T, K, M] with B, T, K "
                             f"of v; got write {_shape(write)}, read {_shape(read)}, clock {_shape(clock)}")
    for name, x in params.items():
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != (K, M):
            raise ValueError(f"spectral_scan: {name} must be [K, M] = [{K}, {M}] (channels of v, modes of "
                             f"write), got {_shape(x)}")
    tensors = {"v": v, "write": write, **gates, **params}
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != (B, K, M, 2, P):
            raise ValueError(f"spectral_scan: initial_state must be [B, K, M, 2, P] = "
                             f"[{B}, {K}, {M}, 2, {P}], got {_shape(initial_state)}")
        tensors["initial_state"] = initial_state
    bad = [n for n, x in tensors.items() if not x.is_floating_point()]
    if bad:
        raise ValueError(f"spectral_scan: {', '.join(bad)} must be floating point tensors")
    devices = {n: str(x.device) for n, x in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"spectral_scan: all inputs must be on one device, got {devices}")
