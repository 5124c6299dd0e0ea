"""hf_accel's C++ kernels (`csrc/`), their builder (`build.py`) and custom ops (`custom_ops.py`): paged and quantized
attention, Linears over packed column panels (`packed_linear.py` for compiled graphs, `eager_packing.py` for eager
calls), structured outputs' grammar mask and the batched LoRA update. The floor under every caller: the step
runtime, compiled generate, the eager speculative loops, the structured and LoRA layers and the engine."""
