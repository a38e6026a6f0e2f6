"""Spectral math of ES-SSM / ESSH: Hankel eigenfilters and their damped-rotation modal fits.

numpy/scipy only (no torch), float64 throughout, cached in-process and on disk
(``$ELASTIC_SSM_CACHE``, default ``~/.cache/elastic_ssm``). Conventions: docs/spectral.md.

* :func:`hankel_matrix` (L) -> Z [L, L] (ES-SSM Eq. 11)
* :func:`hankel_filters` (L, K) -> sigma [K], phi [K, L] (decreasing, unit rows, phi_k(0) > 0)
* :func:`resolved_channels` (L) -> number of eigenvectors float64 resolves (24 at L=2048)
* :func:`fit_damped_modes` (phi_k, m) -> :class:`DampedModes` (ESSH Eq. 4, App. C.1.1)
* :func:`modal_tables` (L, K, m, clip) -> {"rho", "theta", "kc", "ks"}: [K, m]
"""

from .hankel import UnresolvedChannelWarning, hankel_filters, hankel_matrix, resolved_channels
from .modes import DEFAULT_CLIP, DampedModes, fit_damped_modes, modal_tables

__all__ = [
    "DEFAULT_CLIP",
    "DampedModes",
    "UnresolvedChannelWarning",
    "fit_damped_modes",
    "hankel_filters",
    "hankel_matrix",
    "modal_tables",
    "resolved_channels",
]
