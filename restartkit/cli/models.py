"""`model create` and `engine serve`: reference checkpoints and the reference engine."""
from __future__ import annotations

import sys

import click

from restartkit.cli.common import friendly, say


# reference.checkpoint's PRESETS, named here without importing torch (tests/test_architecture.py checks)
MODEL_PRESETS = ["tiny", "tiny-moe", "small", "1b", "8b-shape", "14b-shape", "24b-shape"]

@click.group("model")
def model_group():
    """Reference checkpoints (Hugging Face Llama layout)."""


@model_group.command("create")
@click.option("--preset", type=click.Choice(MODEL_PRESETS), default="tiny", show_default=True)
@click.option("--out", required=True, type=click.Path(file_okay=False))
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where to generate the random weights (cuda is much faster for 8b-shape).")
@friendly
def model_create(preset, out, seed, dtype, device):
    """Write deterministic seeded random weights for a preset.

    \b
    Examples:
      restartkit model create --out ./m
      restartkit model create --preset 8b-shape --dtype bfloat16 --device cuda --out /srv/models/8b"""
    import os
    from restartkit.errors import UsageError
    from restartkit.reference.model.checkpoint import write_checkpoint
    parent = os.path.dirname(os.path.abspath(os.path.expanduser(out)))
    try:
        os.makedirs(parent, exist_ok=True)  # as `mkdir -p` would
    except OSError as e:
        raise UsageError(f"--out {out}: cannot make its parent directory {parent}: {e.strerror or e}",
                         hint="pick an --out under a directory you can write") from None
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: this host has no usable CUDA device", hint="use --device cpu")
    path = write_checkpoint(out, preset, seed=seed, dtype=dtype, device=device, progress=say)
    click.echo(str(path))


@click.group("engine")
def engine_group():
    """The reference engine."""


@engine_group.command("serve", add_help_option=False,
                context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def engine_serve(ctx):
    """Serve a checkpoint: restartkit engine serve --model DIR [--port N] [--device cpu|cuda] ...

    Every option is the reference server's own: restartkit engine serve --help lists them.

    \b
    Examples:
      restartkit engine serve --model ./m --port 8000
      restartkit engine serve --help     # every option"""
    from restartkit.reference.serving import server
    sys.exit(server.main(ctx.args))
