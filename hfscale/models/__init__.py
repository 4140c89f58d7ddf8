"""The models hfscale works on: the built-in tiny Gemma 3, its tokenizer and corpus (`builtin`, `corpus`, `data/`:
the embedded default every command runs offline), the shipped dimension configs of real models, and the dimensions
every layer above reads from a transformers config (`dims`)."""

from .builtin import (BUILTIN, TINY, build_model, dimension_configs, has_tokenizer, is_builtin, known_names, load_config,
                      load_for_eval, load_tokenizer, save_pretrained_dir, tiny_config, tiny_gemma4_config, tokenizer_dir)

__all__ = ["BUILTIN", "TINY", "build_model", "dimension_configs", "has_tokenizer", "is_builtin", "known_names", "load_config",
           "load_for_eval", "load_tokenizer", "save_pretrained_dir", "tiny_config", "tiny_gemma4_config", "tokenizer_dir"]
