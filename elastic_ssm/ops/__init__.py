"""Stateless tensor ops of elastic_ssm; fast paths are chosen by :func:`resolve_backend` (``dispatch.py``).

Importing this package never imports triton or fla: those optional extras load only on their code paths.
"""

from .dispatch import resolve_backend
from .spectral_scan import chunk_spectral_scan, naive_spectral_scan, spectral_scan, spectral_scan_step

__all__ = [
    "chunk_spectral_scan",
    "naive_spectral_scan",
    "resolve_backend",
    "spectral_scan",
    "spectral_scan_step",
]
