"""Stateless tensor ops of elastic_ssm; fast paths are chosen in ``dispatch.py`` (triton and fla load lazily)."""

from .dispatch import available_backends, resolve_backend
from .fft_conv import fft_causal_conv, naive_causal_conv
from .spectral_scan import ModalTables, chunk_spectral_scan, naive_spectral_scan, spectral_scan, spectral_scan_step

__all__ = ["ModalTables", "available_backends", "fft_causal_conv", "naive_causal_conv", "chunk_spectral_scan",
           "naive_spectral_scan", "resolve_backend", "spectral_scan", "spectral_scan_step"]
