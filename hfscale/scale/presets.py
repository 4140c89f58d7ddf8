"""The configs hfscale ships in accelerate_configs/ and ds_configs/: one registry, used by the CLI
(`hfscale config NAME`), by `make configs`, and by the drift test."""

from __future__ import annotations

from .spec import Launch, Parallel, ScaleSpec, Zero

GPUS = 8  # a typical node; `--num-processes` overrides at launch

PRESETS: dict[str, ScaleSpec] = {
    s.name: s
    for s in [
        ScaleSpec("ddp", engine="ddp", launch=Launch(num_processes=GPUS)),
        ScaleSpec("zero1", zero=Zero(stage=1), launch=Launch(num_processes=GPUS)),
        ScaleSpec("zero2", zero=Zero(stage=2), launch=Launch(num_processes=GPUS)),
        ScaleSpec("zero2_offload", zero=Zero(stage=2, offload_optimizer="cpu"), launch=Launch(num_processes=GPUS)),
        ScaleSpec("zero3", zero=Zero(stage=3), launch=Launch(num_processes=GPUS)),
        ScaleSpec(
            "zero3_offload",
            zero=Zero(stage=3, offload_optimizer="cpu", offload_params="cpu"),
            launch=Launch(num_processes=GPUS),
        ),
        ScaleSpec(
            "zero3_nvme",
            zero=Zero(stage=3, offload_optimizer="nvme", offload_params="cpu", nvme_path="/local_nvme/hfscale"),
            launch=Launch(num_processes=GPUS),
        ),
        ScaleSpec("fsdp2", engine="fsdp2", launch=Launch(num_processes=GPUS)),
        ScaleSpec(
            "multinode_zero3",
            zero=Zero(stage=3),
            launch=Launch(num_processes=2 * GPUS, num_machines=2, main_process_ip="10.0.0.1", main_process_port=29500),
        ),
        # long context: DeepSpeed Ulysses over pairs of GPUs (4 data-parallel groups x sp 2), ZeRO-3 over all 8;
        # flash_attention_2 because Ulysses drops the mask and only flash keeps Gemma's sliding window
        ScaleSpec("zero3_sp2", zero=Zero(stage=3), launch=Launch(num_processes=GPUS),
                  parallel=Parallel(sp=2, sp_attention="flash_attention_2")),
        # long context over nodes: Ulysses over groups of 4 GPUs, ZeRO-3 over 4 nodes (recipes/gemma3/27b_sp4_64k.yaml)
        ScaleSpec("multinode_zero3_sp4", zero=Zero(stage=3),
                  launch=Launch(num_processes=4 * GPUS, num_machines=4, main_process_ip="10.0.0.1", main_process_port=29500),
                  parallel=Parallel(sp=4, sp_attention="flash_attention_2")),
        # very long context (ALST's levers, docs/long_context.md): ZeRO-3 with weights and optimizer in host memory,
        # beside the offloaded activations; Ulysses over pairs of GPUs (recipes/gemma3/27b_sp2_128k.yaml launches 2)
        ScaleSpec("zero3_offload_sp2", zero=Zero(stage=3, offload_optimizer="cpu", offload_params="cpu"),
                  launch=Launch(num_processes=GPUS), parallel=Parallel(sp=2, sp_attention="flash_attention_2")),
        # ... and over each node's 8 GPUs, 4 nodes (recipes/gemma4/31b_sp8_256k.yaml)
        ScaleSpec("multinode_zero3_sp8_offload", zero=Zero(stage=3, offload_optimizer="cpu", offload_params="cpu"),
                  launch=Launch(num_processes=4 * GPUS, num_machines=4, main_process_ip="10.0.0.1", main_process_port=29500),
                  parallel=Parallel(sp=8, sp_attention="flash_attention_2")),
        # transformers tensor parallel in pairs (tp 2) x FSDP2 over the 4 pairs
        ScaleSpec("fsdp2_tp2", engine="fsdp2", launch=Launch(num_processes=GPUS), parallel=Parallel(tp=2)),
    ]
}


def preset(name: str) -> ScaleSpec:
    from ..util.errors import ConfigError

    if name not in PRESETS:
        raise ConfigError(f"unknown config {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]
