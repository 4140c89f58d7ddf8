"""Small shared pieces every layer uses and none of them owns: one-line errors (`errors`), staged writes that
never cost data (`atomic`), the on-disk cache (`cache`), quiet third-party output (`quiet`), the optional extras
(`extras`), and what this host computes natively (`hosts`). Imports nothing else from hfscale."""
