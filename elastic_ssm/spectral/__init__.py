"""Spectral math of ES-SSM / ESSH (numpy / scipy, float64, cached in-process and on disk; docs/spectral.md):
Hankel eigenfilters (ES-SSM Eq. 11-12) and their damped-rotation modal fits (ESSH Eq. 4, App. C.1.1)."""

from .hankel import UnresolvedChannelWarning, hankel_filters, hankel_matrix, resolved_channels
from .modes import DEFAULT_CLIP, DampedModes, fit_damped_modes, modal_tables

__all__ = ["DEFAULT_CLIP", "DampedModes", "UnresolvedChannelWarning", "fit_damped_modes", "hankel_filters",
           "hankel_matrix", "modal_tables", "resolved_channels"]
