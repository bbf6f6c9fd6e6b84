"""The CLI explains itself: every command's --help lists its options and an example, and the top-level help
names every strategy (generated from the one list of them)."""
import click

from restartkit.cli import main
from restartkit.contracts import STRATEGY_NAMES
from tests.helpers import run_cli


def commands(group=main, path=()):
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from commands(cmd, (*path, name))
        else:
            yield (*path, name), cmd


def test_the_top_level_help_names_every_strategy():
    out = run_cli("--help").stdout
    for name in STRATEGY_NAMES:
        assert f"  {name} " in out, name


def test_every_command_has_an_example_and_lists_its_options():
    missing = [" ".join(path) for path, cmd in commands() if "Examples:" not in (cmd.help or "")]
    assert not missing, f"no example in the help of: {missing}"
    for path, cmd in commands():
        if path == ("engine", "serve"):
            continue  # its options are the reference server's own: below
        text = cmd.get_help(click.Context(cmd, info_name=" ".join(path)))
        for param in cmd.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert param.opts[0] in text, (path, param.opts[0])


def test_engine_serve_help_shows_the_servers_options():
    r = run_cli("engine", "serve", "--help")
    assert r.returncode == 0, r.stderr
    for flag in ("--model", "--port", "--max-num-seqs", "--served-model-name", "examples:"):
        assert flag in r.stdout, flag
