"""Test support shared by tests/ and benchmarks/, not used by the package itself (tests/test_layout.py checks
that): the trained tiny Gemma 3 fixture (`trained`), the tiny Gemma-4-MoE builder (`tiny_moe`), small Llama / Mistral / Qwen models
with family tokenizers for the GGUF checks (`families`), and the architecture zoo the planner's accuracy is measured on (`zoo`)."""
