"""Compiled generate: hf_accel's own decode loop for `model.generate(..., compile_config=...)` with an hf_accel
cache (`decode_loop.py`), its static paged layout (`paged_rows.py`), the compiled whole step (`step.py`) and the token
choice inside it (`token_choice.py`); the speculative loops' compiled rounds (the target's side: `target_rounds.py`;
each drafter's: `ngram_loop.py`, `draft_loop.py`, `eagle_loop.py`, `eagle_tree_loop.py`, `medusa_loop.py`; their
entries: `speculative_entry.py`)."""
