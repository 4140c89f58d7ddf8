"""Runs that show a configuration works on the real engine, from inside the ranks: the engine proof
(`engine`, `hfscale prove`), sequence / tensor parallelism against one process (`parallel`), the profiler's
launched worker (`profile`, `hfscale profile`), and the demo that strings the main jobs together (`demo`).
The top layer beside the CLI: it may use every other package; none of them imports it."""
