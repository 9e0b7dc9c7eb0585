"""Bounds on what a user may ask for, shared by the run config's sections and `kiln data prepare`.

Apart from the config, which imports the model and so torch: `kiln data prepare` checks its
flags against them in a driver and beside tokenizer actors that never need torch.
"""

MAX_SEQ_LEN = 10_000_000  # ten million tokens of context: past any model's, short of a typo
MAX_INT = 1 << 53  # no config integer goes past this: beyond it a float (YAML's 1e26) is inexact
MAX_STEPS = 1_000_000_000  # a billion optimizer steps: far past any run, short of an absurd typo
