"""Making Medusa heads: training on a frozen model (`train.py`), accuracy and tree calibration (`calibrate.py`), and
the `hf-accel train-medusa` command that runs both (`command.py`). Decoding with heads is `speculative/medusa.py`;
writing them for vLLM is `export/medusa.py`."""
