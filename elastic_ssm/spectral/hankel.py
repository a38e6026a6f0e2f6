"""Hankel spectral channels (ES-SSM App. B.3, Eqs. 10-12; ESSH App. B.2-B.3, Eq. 10): with
mu(lambda) = (1 - lambda) [1, lambda, ..., lambda^(L-1)]^T,

    Z = int_0^1 mu(rho) mu(rho)^T d rho,   Z_ij = 2 / ((i+j)^3 - (i+j))   (1-based i, j)

Eigenpairs in float64, decreasing, unit norm, ``phi_k(0) > 0``; channel k is *resolved* when
``eps * sigma_1 / gap_k <= 1e-2`` (24 at L=2048). Solvers and conventions: docs/spectral.md.

Disk cache of the fixed spectral buffers (these filters and ``modes.py``'s fits): ``.npz`` files in
``$ELASTIC_SSM_CACHE`` (else ``~/.cache/elastic_ssm``), written atomically; every failure is soft (a bad file is a
miss): the cache is an accelerator, never a requirement."""

from __future__ import annotations

import functools
import logging
import operator
import warnings
from pathlib import Path

import numpy as np

from ..utils.files import atomic_writer, cache_dir

__all__ = ["UnresolvedChannelWarning", "hankel_filters", "hankel_matrix", "resolved_channels", "FORMAT", "cache_dir",
           "cache_path", "load_arrays", "save_arrays"]

#: Threshold on eps * sigma_1 / gap_k below which channel k counts as resolved.
RESOLVE_TOL = 1e-2
#: Largest L solved with the dense eigensolver; longer filters use the FFT subspace iteration.
DENSE_MAX_L = 4096
_PROBE = 64  # eigenvalues computed at least, so the resolved count is known from one solve
_OVERSAMPLE = 24  # extra subspace vectors beyond the requested eigenpairs
_POWER_STEPS = 3  # block products with Z before Rayleigh-Ritz

#: Layout tag embedded in every file name; bump it when the stored arrays change meaning.
FORMAT = "v1"

_log = logging.getLogger(__name__)


def cache_path(stem: str) -> Path:
    """Full path of the cache entry ``stem`` (a name without directory or suffix)."""
    return cache_dir() / f"{stem}.{FORMAT}.npz"


def load_arrays(stem: str, expected: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray] | None:
    """The arrays of entry ``stem`` (e.g. ``"hankel_L2048_K32"``) if it holds exactly ``expected`` (name ->
    shape, ``()`` for a scalar); ``None`` on any miss (absent, unreadable, corrupt, or another shape)."""
    path = cache_path(stem)
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            out = {name: np.array(data[name]) for name in expected}
    except Exception as err:  # a corrupt or foreign file is a miss, never a crash
        _log.debug("ignoring unreadable cache file %s: %s", path, err)
        return None
    for name, shape in expected.items():
        if out[name].shape != tuple(shape):
            _log.debug("ignoring cache file %s: %s has shape %s, expected %s", path, name, out[name].shape, shape)
            return None
    return out


def save_arrays(stem: str, arrays: dict[str, np.ndarray]) -> bool:
    """Write ``arrays`` to the entry ``stem`` atomically (mode 0666 less the umask: users can share the cache);
    ``False`` (no error) when the directory is not usable."""
    path = cache_path(stem)
    try:
        with atomic_writer(path) as fh:
            np.savez(fh, **arrays)
        return True
    except OSError as err:
        _log.debug("spectral cache not written (%s): %s", path, err)
        return False



class UnresolvedChannelWarning(UserWarning):
    """More Hankel channels were requested than float64 resolves at this length."""


def _as_int(value: object, name: str, hint: str) -> int:
    """``value`` as a Python int (numpy ints accepted); ValueError naming ``hint`` otherwise."""
    try:
        if not isinstance(value, bool):
            return operator.index(value)
    except TypeError:
        pass
    raise ValueError(f"{name} must be an integer, got {value!r}; {hint}")


def check_length(L: object) -> int:
    """Validate a filter length: an integer ``L >= 2``; returns it as ``int``."""
    L = _as_int(L, "L", "pass the filter length (sequence length), an integer >= 2")
    if L < 2:
        raise ValueError(f"L must be >= 2 (the filter length), got L={L}; pass L >= 2")
    return L


def check_channels(L: int, K: object) -> int:
    """Validate a channel count ``1 <= K <= L`` for length ``L``; returns it as ``int``."""
    K = _as_int(K, "K", f"pass the number of channels, 1 <= K <= L={L}")
    if not 1 <= K <= L:
        raise ValueError(f"K must satisfy 1 <= K <= L={L}, got K={K}; pass a channel count in that range")
    return K


def _hankel_sequence(L: int) -> np.ndarray:
    """Anti-diagonal values h[n] = Z_ij for n = i+j-2 = 0..2L-2: 2/((n+1)(n+2)(n+3)), float64 [2L-1]."""
    n = np.arange(2 * L - 1, dtype=np.float64)
    return 2.0 / ((n + 1.0) * (n + 2.0) * (n + 3.0))


def hankel_matrix(L: int) -> np.ndarray:
    """Z of ES-SSM Eq. 11 (ESSH Eq. 10) for filter length L >= 2: float64 [L, L], ``2 / ((i+j)^3 - (i+j))``."""
    L = check_length(L)
    idx = np.arange(L)
    return _hankel_sequence(L)[idx[:, None] + idx[None, :]]  # [L, L]


def _hankel_matmul(h: np.ndarray, X: np.ndarray) -> np.ndarray:
    """Z @ X for the Hankel Z with anti-diagonals ``h`` [2L-1], X [L, p] -> [L, p], by FFT."""
    import scipy.fft  # here, not at the top: loading a saved model never needs scipy (~0.3 s of import)
    L = X.shape[0]
    n = scipy.fft.next_fast_len(3 * L - 2, real=True)
    spec = scipy.fft.rfft(h, n)[:, None] * scipy.fft.rfft(X[::-1], n, axis=0)  # correlation as convolution
    return scipy.fft.irfft(spec, n, axis=0)[L - 1 : 2 * L - 1]


def _top_eigenpairs(L: int, n: int, method: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """The n (1 <= n <= L) largest eigenpairs of Z: sigma float64 [n] decreasing, phi float64 [n, L] (unit rows,
    ``phi_k(0) > 0``). ``method``: 'dense' (LAPACK eigh subset) | 'subspace' (FFT block subspace iteration +
    Rayleigh-Ritz) | 'auto' (dense for L <= DENSE_MAX_L or when n is a large share of L)."""
    if method == "auto":
        method = "dense" if L <= DENSE_MAX_L or 4 * (n + _OVERSAMPLE) > L else "subspace"
    if method == "dense":
        import scipy.linalg
        w, v = scipy.linalg.eigh(hankel_matrix(L), subset_by_index=[L - n, L - 1])  # ascending
        sigma, phi = w[::-1], v[:, ::-1].T
    elif method == "subspace":
        h = _hankel_sequence(L)
        p = min(L, n + _OVERSAMPLE)
        basis = np.random.default_rng(L).standard_normal((L, p))  # [L, p], deterministic per L
        for _ in range(_POWER_STEPS):
            basis = np.linalg.qr(_hankel_matmul(h, basis))[0]
        small = basis.T @ _hankel_matmul(h, basis)  # [p, p] Rayleigh quotient
        w, u = np.linalg.eigh(0.5 * (small + small.T))
        sigma, phi = w[::-1][:n], (basis @ u[:, ::-1][:, :n]).T
    else:
        raise ValueError(f"method must be 'auto', 'dense' or 'subspace', got {method!r}")
    phi = phi * np.where(phi[:, :1] < 0, -1.0, 1.0)  # sign convention phi_k(0) > 0
    return np.ascontiguousarray(sigma), np.ascontiguousarray(phi)


def _resolved_count(spectrum: np.ndarray, L: int) -> tuple[int, bool]:
    """(count, determined): the resolved prefix length from the top eigenvalues ``spectrum`` [n] (decreasing);
    ``determined`` is False when all judged channels are resolved and more exist (count is a lower bound)."""
    n = spectrum.shape[0]
    below = spectrum[:-1] - spectrum[1:]  # gap_k to sigma_{k+1}, k = 1..n-1
    above = np.concatenate([[np.inf], below[:-1]])  # gap_k to sigma_{k-1}
    gaps = np.minimum(above, below)
    if n == L:  # the last channel has only a left neighbour
        gaps = np.concatenate([gaps, [below[-1] if n > 1 else np.inf]])
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.finfo(np.float64).eps * spectrum[0] / np.where(gaps > 0, gaps, 0.0)
    ok = ratio <= RESOLVE_TOL
    count = int(ok.size if ok.all() else np.argmin(ok))
    return count, count < ok.size or n == L


@functools.lru_cache(maxsize=64)
def _filters(L: int, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sigma [K], phi [K, L], spectrum [n]) from memory, disk, or a fresh solve of n >= K+1 pairs."""
    n = min(L, max(K + 1, _PROBE))
    stem = f"hankel_L{L}_K{K}"
    hit = load_arrays(stem, {"sigma": (K,), "phi": (K, L), "spectrum": (n,)})
    if hit is None:
        spectrum, phi = _top_eigenpairs(L, n)
        hit = {"sigma": spectrum[:K].copy(), "phi": phi[:K].copy(), "spectrum": spectrum}
        save_arrays(stem, hit)
    for arr in hit.values():
        arr.setflags(write=False)
    return hit["sigma"], hit["phi"], hit["spectrum"]


def resolved_channels(L: int) -> int:
    """How many leading Hankel eigenvectors float64 resolves at filter length ``L`` >= 2 (the prefix with
    ``eps * sigma_1 / gap_k <= 1e-2``; 24 at L=2048): int in [1, L]."""
    L = check_length(L)
    K = 1
    while True:
        count, determined = _resolved_count(_filters(L, K)[2], L)
        if determined:
            return count
        K = min(L, 2 * (count + 1))


def _resolved_at(L: int, spectrum: np.ndarray) -> int:
    """Resolved count from an already computed top spectrum, solving for more only if needed."""
    count, determined = _resolved_count(spectrum, L)
    return count if determined else resolved_channels(L)


def _warn_unresolved(caller: str, L: int, K: int, resolved: int) -> None:
    """Warn (never fail) when K exceeds the resolved channel count at length L."""
    if K > resolved:
        warnings.warn(f"{caller}(L={L}, K={K}): float64 resolves only the first {resolved} Hankel eigenvectors at "
                      f"L={L} (eps*sigma_1/gap_k <= {RESOLVE_TOL:g}); channels {resolved + 1}..{K} are numerically "
                      f"arbitrary. Pass K <= {resolved} where the exact filters matter.", UnresolvedChannelWarning,
                      stacklevel=3)


def hankel_filters(L: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    """The K (1 <= K <= L) leading Hankel spectral channels of length L >= 2 (ES-SSM Eq. 11-12, ESSH Sec. 3):
    sigma float64 [K] (decreasing eigenvalues of Z), phi float64 [K, L] (unit rows, ``phi_k(0) > 0``). Warns
    (:class:`UnresolvedChannelWarning`) when K exceeds :func:`resolved_channels` (L)."""
    L = check_length(L)
    K = check_channels(L, K)
    sigma, phi, spectrum = _filters(L, K)
    _warn_unresolved("hankel_filters", L, K, _resolved_at(L, spectrum))
    return sigma.copy(), phi.copy()
