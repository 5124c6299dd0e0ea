"""Making EAGLE heads: the frozen target's features (`features.py`), the training-time-test unroll (`unroll.py`),
the training loop with checkpoints (`train.py`) and the `hf-accel train-eagle` command (`command.py`). Decoding with
a head is `speculative/eagle.py`."""
