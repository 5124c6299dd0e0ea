"""The step runtime that compiled `generate` and the engine share: the K/V pool (`kv_pool.py`), attention over it
(`attention.py`), a model forward over packed rows (`step_forward.py`, `step_inputs.py`), graphs compiled with frozen
weights (`frozen_graphs.py`, `dynamo.py`) and CUDA graphs of decode steps (`cuda_graphs.py`)."""
