"""Quantised weight formats: packing, quantisation and dequantisation references (no kernels)."""
