"""The recipes' one entry (recipes/train_clm.py, qat_clm.py, distill_clm.py): what each cannot honour of the
settings it accepts, refused in one line from one table, and the `main` they all run.

Every recipe accepts every TrainConfig setting and builds its model through hfscale.train.prepare, so
checkpointing, the long-context levers and profile_memory work in all three. What a recipe cannot do is in
UNSUPPORTED, checked when its config is built (the settings) and again at launch (its parallelism): one line
naming the fix, exit 2, never a setting silently dropped.

    def main(argv=None) -> int:
        from hfscale.train.recipe import run_recipe
        return run_recipe(argv, __doc__, QATRecipeConfig, train, check=check)
"""

from __future__ import annotations

import os

from ..util.errors import ConfigError

# (recipe, or None for both, setting, asked for? (config, the launch's scale.spec.Parallel or None before the launch is
# read), the line: {r} the recipe, {k} whose attention kernel it runs). Parallelism is train_clm's (Ulysses SP, its data
# plan and loss); its own tp / cp refusal is its check_parallel.
UNSUPPORTED = (
    ("qat_clm", "adapter", lambda c, p: c.adapter != "none",
     "qat_clm trains LoRA on the fake-quantized base with --lora-rank N (got adapter {c.adapter}); drop adapter / --adapter"),
    ("distill_clm", "adapter", lambda c, p: c.adapter != "none",  # its student trains in full
     "distill_clm trains the whole student (got adapter {c.adapter}); drop --adapter, or fine-tune with adapters in "
     "recipes/train_clm.py"),
    (None, "padding_free", lambda c, p: c.padding_free,
     "{r} reads packed rows of seq_len under {k} own attention kernel; padding_free (one row per micro batch, "
     "attention: varlen) is recipes/train_clm.py's: drop padding_free"),
    (None, "attention", lambda c, p: c.attention,
     "{r} runs {k} own attention kernel (got attention {c.attention}); drop attention / --attention "
     "(recipes/train_clm.py applies it)"),
    ("qat_clm", "tiled_loss", lambda c, p: c.tiled_loss and c.distill > 0,
     "qat_clm's distill term needs the whole logits, which tiled_loss never builds (got tiled_loss {c.tiled_loss}, "
     "distill {c.distill}); set tiled_loss: 0, or distill: 0"),
    ("distill_clm", "tiled_loss", lambda c, p: c.tiled_loss,
     "distill_clm's KL to the teacher needs the student's whole logits, which tiled_loss never builds (got tiled_loss "
     "{c.tiled_loss}); set tiled_loss: 0"),
    (None, "parallelism", lambda c, p: p is not None and p.size > 1,
     "{r} runs data parallelism only; this launch asks for sp {p.sp} / tp {p.tp} / cp {p.cp}: use an accelerate "
     "config without parallelism_config (accelerate_configs/zero2.yaml), or recipes/train_clm.py for sequence parallelism"),
)
# the recipes the table covers, and whose attention kernel each runs (qat: the model's; distill: student's and teacher's)
KERNEL_OF = {"qat_clm": "the model's", "distill_clm": "the models'"}


def refuse_unsupported(cfg, parallel=None) -> None:
    """ConfigError with the table's line for the first setting cfg's recipe (its config class's `recipe`) cannot
    honour; `parallel`: the launch's sizes, None where they are not read yet (a config being built)."""
    if cfg.recipe not in KERNEL_OF:
        return
    for recipe, _setting, asked, line in UNSUPPORTED:
        if recipe in (None, cfg.recipe) and asked(cfg, parallel):
            raise ConfigError(line.format(c=cfg, p=parallel, r=cfg.recipe, k=KERNEL_OF[cfg.recipe]))


def run_recipe(argv, doc: str, cls, train, check=None, check_launch=None, config_help: str = "recipe YAML") -> int:
    """A recipe's whole `main`, for every rank: parse, load the config (`cls`, whose `recipe` names the run), refuse
    what the recipe cannot honour of this launch, `check(cfg)` (the recipe's own refusals before anything loads),
    preflight, `check_launch(cfg, pre, parallel)` (those that need the model's config or the launch), the token store, then
    `train(cfg, force, pre, parallel, store) -> int`. Exit: 2 with one line from rank 0 for a refused run
    (loop.setup_failed); a run that stopped on every rank together, loop.stopped's status (75 preempted, 74 a
    failed save); anything else is raised."""
    from ..util.errors import HfscaleError
    from .loop import setup_failed, stopped

    tag = cls.recipe
    rank = int(os.environ.get("RANK", "0"))  # the launcher's environment is read here, at the recipe's edge
    try:
        from .config import parse_recipe_args

        config_path, overrides, force = parse_recipe_args(argv, doc, config_help, cls)  # before torch is imported
        from ..scale.ulysses import launch_parallel
        from .config import load_recipe
        from .loop import prepare_data, preflight

        cfg = load_recipe(config_path, overrides, cls=cls)
        parallel = launch_parallel(os.environ)
        refuse_unsupported(cfg, parallel)
        if check is not None:
            check(cfg)
        pre = preflight(cfg, force, source=config_path)
        if pre.launch.on_cpu:  # a CPU step's freed tensors stay with the process for the next step
            from ..util.allocator import retain_freed_memory

            retain_freed_memory()
        if check_launch is not None:
            check_launch(cfg, pre, parallel)
        store = prepare_data(pre, rank, tag)
    except HfscaleError as e:
        return setup_failed(e, tag, rank)  # one line from rank 0; the other ranks do not leave first
    try:
        return train(cfg, force, pre, parallel, store)
    except Exception as e:  # a preemption (75), a failed save (74), a resume the ranks disagree on (2); else re-raised
        return stopped(e, tag, rank)
