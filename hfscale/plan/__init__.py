"""Memory prediction and planning: dims (a model's shapes and exact parameter count), memory (bytes per
rank by component), planner (rank strategies for a hardware budget), write / plot (the pick's configs, bars)."""
