"""Pieces of the training recipe (recipes/train_clm.py) that are library code: the recipe config,
batch arithmetic, activation checkpointing, checkpoint/resume and the metrics log. The recipe
itself stays a readable script; `import hfscale.train` gives the same pieces to your own loop."""
