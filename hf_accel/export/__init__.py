"""Writers for other runtimes: `export_vllm` (bf16 or compressed-tensors int8 / int4 weights, Medusa heads,
`serve.sh`). Quantized exports need the `export` extra (`compressed-tensors`); `hf_accel` itself does not import
this package."""

from .vllm import VLLM_VERSION, ServeCommand, export_vllm

__all__ = ["VLLM_VERSION", "ServeCommand", "export_vllm"]
