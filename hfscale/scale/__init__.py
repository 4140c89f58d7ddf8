"""Scale configs: validated specs (spec, presets), pure mappings to DeepSpeed JSON and accelerate YAML
(deepspeed, accelerate), their files (files, load) and the runtime factory that distributes on CPU hosts too."""
