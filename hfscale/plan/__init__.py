"""Memory prediction and planning. `plan(model, seq_len=..., micro_batch=..., hardware=...) -> Plan` (api.py) is
the one call: it traces the step (trace.py, peak.py; DeepSpeed's buffers from zero.py), or uses the analytic
terms (memory.py, parallel.py) where asked or where a step cannot be traced, ranks strategies for a hardware
budget (planner.py) and writes / plots the pick (write.py, plot.py)."""


def __getattr__(name):  # `from hfscale.plan import plan, Plan` without importing the planner at package import
    if name in ("plan", "Plan", "Serving", "Hardware"):
        from . import api, planner

        return getattr(api, name, None) or getattr(planner, name)
    raise AttributeError(name)
