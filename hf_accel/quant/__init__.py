"""Quantization: pure tensor ops, weight-only quantized Linear modules, presets and the transformers quantizer."""
