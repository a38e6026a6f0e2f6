"""Damped-rotation modal fits of the Hankel filters by the matrix-pencil method (ESSH Eq. 4, App. C.1.1, B.7):

    phi_k(t) ~ sum_i rho_i^t (kc_i cos(theta_i t) - ks_i sin(theta_i t)),   t = 0..L-1,

the impulse response of ESSH Eq. 5 with unit gates and no clock (readout kappa = (kc, -ks)); docs/spectral.md."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from . import hankel
from .hankel import _as_int, _filters, _resolved_at, _warn_unresolved, check_channels, check_length

__all__ = ["DEFAULT_CLIP", "DampedModes", "fit_damped_modes", "modal_tables"]

#: Default bound on fitted pole magnitudes (DESIGN: clip at 1 - 1e-4).
DEFAULT_CLIP = 1.0 - 1e-4


@dataclasses.dataclass(frozen=True, eq=False)
class DampedModes:
    """m damped rotation modes of one channel (ESSH Eq. 4), float64 [m] fields: ``rho`` pole magnitudes in
    [0, clip], ``theta`` = arg(pole) in (-pi, pi], ``kc`` / ``ks`` real / imaginary part of the complex residue
    (the readout vector is (kc, -ks))."""

    rho: np.ndarray
    theta: np.ndarray
    kc: np.ndarray
    ks: np.ndarray

    def __post_init__(self) -> None:
        fields = {f.name: np.asarray(getattr(self, f.name), dtype=np.float64) for f in dataclasses.fields(self)}
        shapes = {arr.shape for arr in fields.values()}
        if len(shapes) != 1 or len(next(iter(shapes))) != 1:
            raise ValueError(f"DampedModes fields must be 1-D arrays of one length m, got shapes "
                             f"{ {k: v.shape for k, v in fields.items()} }; pass rho, theta, kc, ks as [m] arrays")
        for name, arr in fields.items():
            object.__setattr__(self, name, arr)

    @property
    def num_modes(self) -> int:
        """m, the number of modes."""
        return int(self.rho.shape[0])

    @property
    def poles(self) -> np.ndarray:
        """Complex poles rho * exp(i theta), complex128 [m]."""
        return self.rho * np.exp(1j * self.theta)

    @property
    def residues(self) -> np.ndarray:
        """Complex residues kc + i ks, complex128 [m]."""
        return self.kc + 1j * self.ks

    def filter(self, L: int) -> np.ndarray:
        """The modal filter of ESSH Eq. 4 at lags t = 0..L-1, float64 [L]."""
        L = check_length(L)
        t = np.arange(L, dtype=np.float64)  # [L]
        phase = self.theta[:, None] * t  # [m, L], float64 phase
        decay = np.power(self.rho[:, None], t)  # [m, L]
        return np.sum(decay * (self.kc[:, None] * np.cos(phase) - self.ks[:, None] * np.sin(phase)), axis=0)

    def relative_error(self, phi_k: np.ndarray) -> float:
        """||filter - phi_k||_2 / ||phi_k||_2 (ESSH App. B.7, epsilon_k^(m)) for a 1-D target [L]."""
        phi_k = _as_signal(phi_k)
        return float(np.linalg.norm(self.filter(phi_k.shape[0]) - phi_k) / np.linalg.norm(phi_k))


def _as_signal(phi_k: object) -> np.ndarray:
    """A finite, nonzero 1-D float64 signal of length >= 2, or a ValueError saying what to pass."""
    arr = np.asarray(phi_k, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"phi_k must be 1-D (one filter [L]), got shape {arr.shape}; pass one row, e.g. phi[k - 1]")
    if arr.shape[0] < 2:
        raise ValueError(f"phi_k must have length L >= 2, got {arr.shape[0]}; pass a whole filter [L]")
    if not np.all(np.isfinite(arr)):
        raise ValueError("phi_k contains NaN or inf; pass a finite filter")
    if not np.any(arr):
        raise ValueError("phi_k is identically zero, nothing to fit; pass a nonzero filter")
    return arr


def _check_modes(L: int, m: object) -> int:
    """Validate the mode count 1 <= m <= L/4 (the pencil parameter) for a length-L filter."""
    m = _as_int(m, "m", "pass a number of modes 1 <= m <= L/4")
    if not 1 <= m <= L // 4:
        raise ValueError(f"m must satisfy 1 <= m <= L/4 = {L // 4} (the pencil parameter) for L={L}, got m={m}; "
                         "pass fewer modes or a longer filter")
    return m


def _check_clip(clip: object) -> float:
    """Validate the pole-magnitude bound: a float in (0, 1]."""
    try:
        value = float(clip)
    except (TypeError, ValueError):
        value = float("nan")
    if not 0.0 < value <= 1.0:
        raise ValueError(f"clip bounds pole magnitudes, must lie in (0, 1]; got {clip!r}, pass e.g. 0.9999")
    return value


def fit_damped_modes(phi_k: np.ndarray, m: int, clip: float = DEFAULT_CLIP) -> DampedModes:
    """Matrix-pencil fit (ESSH Eq. 4, App. C.1.1) of one filter phi_k float64 [L] (L >= 4) with m modes (poles;
    a conjugate pair uses two), 1 <= m <= L/4; pole magnitudes above ``clip`` in (0, 1] are scaled down to it."""
    y = _as_signal(phi_k)  # [L]
    L = y.shape[0]
    m = _check_modes(L, m)
    clip = _check_clip(clip)
    pencil = L // 4
    data = np.lib.stride_tricks.sliding_window_view(y, pencil + 1)  # Y [L-P, P+1], Y[r, c] = y[r+c]
    row_space = np.linalg.svd(data, full_matrices=False)[2][:m]  # W = V_m^T [m, P+1]
    shift = row_space[:, 1:] @ np.linalg.pinv(row_space[:, :-1])  # [m, m], eigenvalues = poles
    poles = np.linalg.eigvals(shift)  # complex [m], conjugate pairs exact for a real matrix
    theta = np.angle(poles)
    theta = np.where(theta <= -np.pi, np.pi, theta)  # arg in (-pi, pi]
    rho = np.minimum(np.abs(poles), clip)
    poles = np.where(np.abs(poles) > clip, rho * np.exp(1j * theta), poles)
    t = np.arange(L, dtype=np.float64)
    vander = np.power(poles[None, :], t[:, None])  # [L, m]
    res = np.linalg.lstsq(vander, y.astype(np.complex128), rcond=None)[0]  # complex [m]
    return DampedModes(rho=rho, theta=theta, kc=res.real.copy(), ks=res.imag.copy())


_TABLE_KEYS = ("rho", "theta", "kc", "ks")


@functools.lru_cache(maxsize=16)
def _tables(L: int, K: int, m: int, clip: float) -> dict[str, np.ndarray]:
    """Read-only [K, m] tables from memory, disk (key (L, K, m, clip)), or fresh fits."""
    stem = f"modes_L{L}_K{K}_m{m}_clip{clip!r}"
    hit = hankel.load_arrays(stem, {**{key: (K, m) for key in _TABLE_KEYS}, "resolved": ()})
    if hit is None:
        _, phi, spectrum = _filters(L, K)  # phi [K, L] as hankel_filters returns it (without its warning)
        fits = [fit_damped_modes(phi[k], m, clip) for k in range(K)]
        hit = {key: np.stack([getattr(f, key) for f in fits]) for key in _TABLE_KEYS}
        hit["resolved"] = np.array(_resolved_at(L, spectrum))
        hankel.save_arrays(stem, hit)
    for arr in hit.values():
        arr.setflags(write=False)
    return hit


def modal_tables(L: int, K: int, m: int, clip: float = DEFAULT_CLIP) -> dict[str, np.ndarray]:
    """ESSH App. C.1.1 initialisation tables: float64 [K, m] arrays ``"rho"``, ``"theta"``, ``"kc"``, ``"ks"``,
    row k-1 the ``fit_damped_modes`` of Hankel filter k (L >= 4, 1 <= K <= L, 1 <= m <= L/4, clip in (0, 1]);
    warns as ``hankel_filters`` does (the paper fits K=32 at L=2048, 24 resolved)."""
    L = check_length(L)
    K = check_channels(L, K)
    m = _check_modes(L, m)
    clip = _check_clip(clip)
    hit = _tables(L, K, m, clip)
    _warn_unresolved("modal_tables", L, K, int(hit["resolved"]))
    return {key: hit[key].copy() for key in _TABLE_KEYS}
