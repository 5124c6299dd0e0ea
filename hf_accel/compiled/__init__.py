"""Compiled generate: hf_accel's own decode loop for `model.generate(..., compile_config=...)` with an hf_accel
cache (`loop.py`), its static paged layout (`paged_rows.py`), the compiled whole step (`step.py`) and the token
choice inside it (`token_choice.py`)."""
