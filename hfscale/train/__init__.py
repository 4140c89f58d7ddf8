"""Pieces of the training recipes (recipes/train_clm.py, qat_clm.py, distill_clm.py) that are library code: the recipe
config, the one `main` they run and what each cannot honour (`recipe`), the one model builder (`prepare`), the step
loop, checkpoint/resume and the metrics log. The recipes stay readable scripts; `import hfscale.train` gives the
same pieces to your own loop."""
