"""Compression: one scheme registry (schemes), PTQ to a reloadable transformers directory (ptq, save),
GPTQ from calibration data (gptq), QAT prepare -> train -> convert (qat, ggml_grid for llama.cpp's
Q4_0 grid) and the quality report (evaluate). Submodules import torch; this package does not."""
