"""Launched by tests/test_checkpointing.py under `accelerate launch` with the config set `hfscale plan --write`
wrote: trains the tiny model one way (WAY = recipe | trainer | loop) and counts, per decoder layer, the
calls of its attention module with gradients on. transformers checkpoints a layer's `forward`, so a
checkpointed layer's attention runs twice per micro batch (again when backward recomputes it), any
other layer's once.

    python tests/scripts/ckpt_probe.py WAY PLAN_DIR OUT_DIR
"""

import atexit
import json
import os
import runpy
import sys
from pathlib import Path

import torch
import yaml

way, plan_dir, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
ROOT = Path(__file__).resolve().parents[2]
calls: dict[int, int] = {}


def count(module, args, output):  # one global hook: sees the recipe's, Trainer's and the loop's model alike
    idx = getattr(module, "layer_idx", None)
    if type(module).__name__.endswith("Attention") and isinstance(idx, int) and torch.is_grad_enabled():
        calls[idx] = calls.get(idx, 0) + 1


torch.nn.modules.module.register_module_forward_hook(count)


def torn_down():
    """Registered before anything of hfscale's, so it runs after hfscale's exit teardown (atexit is LIFO): records
    whether the process group was still alive when interpreter shutdown would begin (the SIGABRT exit race)."""
    import torch.distributed as dist

    (out / f"{way}_exit_rank{os.environ.get('RANK', '0')}.txt").write_text(str(dist.is_initialized()))


atexit.register(torn_down)
recipe = yaml.safe_load((plan_dir / "recipe.yaml").read_text())
args_yaml = yaml.safe_load((plan_dir / "training_args.yaml").read_text())
steps, micro_batches = 1, args_yaml["gradient_accumulation_steps"]

if way == "recipe":
    sys.argv = ["train_clm.py", "--config", str(plan_dir / "recipe.yaml"), "--output-dir", str(out / "run"),
                "--max-steps", str(steps), "--eval-every", "0", "--save-every", "0", "--eval-blocks", "2",
                "--max-train-blocks", "64", "--warmup-steps", "0", "--progress", "false"]
    code = runpy.run_path(str(ROOT / "recipes" / "train_clm.py"), run_name="recipe")["main"]()
    assert not code, f"recipe exited {code}"
elif way == "trainer":
    from transformers import Trainer, TrainingArguments

    from hfscale.data.corpus import load_text, packed_blocks
    from hfscale.models import build_model, load_tokenizer

    blocks = packed_blocks(load_tokenizer("tiny-gemma3"), load_text()["train"]["text"][:200], recipe["seq_len"])

    class Blocks(torch.utils.data.Dataset):
        def __len__(self):
            return len(blocks)

        def __getitem__(self, i):
            return {"input_ids": blocks[i], "labels": blocks[i]}

    # the written training_args.yaml as it is, plus what a CPU host needs (use_cpu, gloo: Trainer refuses bf16 on CPU without use_cpu)
    args = TrainingArguments(output_dir=str(out / "trainer"), max_steps=steps, report_to=[], save_strategy="no",
                             dataloader_drop_last=True, use_cpu=True, ddp_backend="gloo", **args_yaml)
    # on CPU, ZeRO-3's zero.Init inside from_config asks deepspeed.comm (not torch.distributed) for the world size,
    # and deepspeed.comm is only set up by deepspeed.init_distributed: without it DeepSpeed 0.19 counts 1 process
    # ("train_batch_size 8 != 1 * 4 * 1"); on GPUs accelerate's state calls it. Harmless for ZeRO-1/2.
    if args_yaml.get("deepspeed"):
        import deepspeed

        assert args.device.type == "cpu"
        deepspeed.init_distributed(dist_backend="gloo")
        assert deepspeed.comm.get_world_size() == 2
    from hfscale.scale.runtime import end_process_group_at_exit

    end_process_group_at_exit()  # Trainer leaves the process group to interpreter shutdown: the SIGABRT exit race
    Trainer(model=build_model("tiny-gemma3"), args=args, train_dataset=Blocks()).train()
else:  # a plain accelerate loop, checkpointing the way the plan's recipe.yaml says
    from hfscale.scale.checkpointing import apply_checkpointing_
    from hfscale.data.corpus import load_text, packed_blocks
    from hfscale.models import build_model, load_tokenizer
    from hfscale.scale.runtime import make_accelerator, make_optimizer

    accelerator = make_accelerator(gradient_accumulation_steps=micro_batches)
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = recipe["micro_batch"]
    model = build_model("tiny-gemma3")
    apply_checkpointing_(model, recipe["checkpointing"])
    optimizer = make_optimizer(accelerator, model, lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    blocks = packed_blocks(load_tokenizer("tiny-gemma3"), load_text()["train"]["text"][:200], recipe["seq_len"])
    for m in range(micro_batches):
        batch = blocks[(m * 2 + accelerator.process_index) * recipe["micro_batch"]:][: recipe["micro_batch"]]
        with accelerator.accumulate(model):
            accelerator.backward(model(input_ids=batch, labels=batch).loss)
            optimizer.step()
            optimizer.zero_grad()

rank = int(os.environ.get("RANK", "0"))
per_layer = [calls[i] for i in sorted(calls)]
(out / f"{way}_rank{rank}.json").write_text(json.dumps({
    "world": int(os.environ.get("WORLD_SIZE", "1")), "calls_per_layer": per_layer, "micro_batches": steps * micro_batches,
}))

# the report is written: end the rank without interpreter finalization, where gloo / DeepSpeed threads can race the
# dying interpreter (SIGABRT "terminate called without an active exception", seen once in a clean-clone suite)
from hfscale.scale.runtime import exit_rank  # noqa: E402

exit_rank(0)
