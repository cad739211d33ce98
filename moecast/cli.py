"""The ``moecast`` command: one table maps each subcommand to a plain typed function.

Like litgpt's CLI, the functions live in the stage packages and jsonargparse turns
their signatures and docstrings into options (and ``--config`` YAML files). Only the
chosen subcommand's module is imported, so ``moecast --help`` stays fast.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

# name -> "module:function" (a nested dict is a command group, e.g. `moecast traces info`)
COMMANDS: dict[str, str | dict[str, str]] = {
    "build-tiny": "moecast.collect.tiny:build_tiny",
    "collect": "moecast.collect.commands:collect",
    "import": {"moe-beyond": "moecast.collect.moe_beyond:import_moe_beyond"},
    "traces": {
        "info": "moecast.collect.info:traces_info",
        "merge": "moecast.collect.commands:merge_traces",
    },
    "train": "moecast.train.cli:train",
    "predictors": {
        "eval": "moecast.predictors.commands:evaluate",
        "remember": "moecast.predictors.commands:remember",
    },
    "profile": "moecast.runtime.commands:profile",
    "replay": "moecast.runtime.commands:replay",
    "compare": "moecast.runtime.commands:compare",
    "run": "moecast.runtime.live_cli:run",
    "eval-accuracy": "moecast.runtime.live_cli:eval_accuracy",
    "demo": "moecast.demo:demo",
}
# Commands that parse their own arguments (LightningCLI owns `train`).
RAW_ARGV = {"train"}
# Users say `moecast collect traces ...`; it is the same command.
ALIASES = {("collect", "traces"): ("collect",)}


def _resolve(target: str) -> Callable:
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def _describe(target: str) -> str:
    """The first line of the target's docstring, read from its source without importing it
    (``moecast --help`` must not import torch)."""
    import ast
    import importlib.util

    module, func = target.split(":")
    try:
        origin = importlib.util.find_spec(module).origin
        tree = ast.parse(Path(origin).read_text(encoding="utf-8"))
        node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == func)
        return (ast.get_docstring(node) or "").strip().splitlines()[0].rstrip(".")
    except (AttributeError, ImportError, OSError, StopIteration, SyntaxError, IndexError):
        return module.replace("moecast.", "")


def _description(func: Callable) -> str:
    """The docstring above its ``Args:`` section: ``--help`` shows it whole, not its first line."""
    import inspect
    import re

    doc = inspect.getdoc(func) or ""
    return re.split(r"\n(?:Args|Arguments|Returns|Raises|Yields):\s*\n", doc)[0].strip()


def _usage() -> str:
    lines = ["usage: moecast COMMAND [options]   (moecast COMMAND --help for its options)", "", "commands:"]
    for name, target in COMMANDS.items():
        for sub, t in target.items() if isinstance(target, dict) else [("", target)]:
            lines.append(f"  {(name + ' ' + sub).strip():<24}{_describe(t)}")
    return "\n".join(lines)


def _underscore(arg: str) -> str:
    # Options are spelled with dashes on the command line (--max-requests) and with
    # underscores in Python signatures; accept both.
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name[:2] + name[2:].replace("-", "_") + eq + value


def _bare_flags(func: Callable, args: list[str]) -> list[str]:
    # `--json`, `--cold`, `--gate-inputs` alone mean true, as users expect of flags;
    # jsonargparse wants a value for bool parameters, so give it one.
    import inspect
    import typing

    try:
        hints = typing.get_type_hints(func)
    except Exception:
        return args
    flags = {f"--{n}" for n, t in hints.items() if t is bool and n in inspect.signature(func).parameters}
    out: list[str] = []
    for i, arg in enumerate(args):
        out.append(arg)
        nxt = args[i + 1] if i + 1 < len(args) else None
        if arg in flags and (nxt is None or nxt.startswith("-") or nxt.lower() not in ("true", "false")):
            out.append("true")
    return out


def _list_positional(func: Callable, args: list[str]) -> list[str]:
    # `moecast traces merge A B --out C`: jsonargparse reads a list positional as one JSON
    # value, so the leading bare words become that list when the first parameter is a list.
    import inspect
    import json
    import typing

    params = list(inspect.signature(func).parameters)
    try:
        hint = typing.get_type_hints(func).get(params[0]) if params else None
    except Exception:
        return args
    if typing.get_origin(hint) is not list:
        return args
    n = 0
    while n < len(args) and not args[n].startswith("-"):
        n += 1
    if n == 0 or (n == 1 and args[0].lstrip().startswith("[")):
        return args
    return [json.dumps(args[:n]), *args[n:]]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return
    if argv[0] in ("-V", "--version"):
        from moecast import __version__

        print(__version__)
        return
    for alias, real in ALIASES.items():
        if tuple(argv[: len(alias)]) == alias:
            argv = list(real) + argv[len(alias) :]
    name, rest = argv[0], argv[1:]
    target = COMMANDS.get(name)
    if target is None:
        sys.exit(f"moecast: unknown command {name!r}; run `moecast --help` for the list")
    prog = f"moecast {name}"
    if isinstance(target, dict):
        if rest and rest[0] in ("-h", "--help"):
            print("\n".join(f"  moecast {name} {sub:<14}{_describe(t)}" for sub, t in target.items()))
            return
        if not rest or rest[0] not in target:
            sys.exit(
                f"moecast {name}: choose one of {', '.join(target)} (e.g. `moecast {name} {next(iter(target))} --help`)"
            )
        prog += f" {rest[0]}"
        target, rest = target[rest[0]], rest[1:]
    func = _resolve(target)
    from moecast.errors import run_command

    if name in RAW_ARGV:
        run_command(lambda: func(rest))
        return
    import argparse

    from jsonargparse import DefaultHelpFormatter, auto_cli

    class Formatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
        """jsonargparse's, with the description's paragraphs and lists kept as written."""

    rest = _list_positional(func, _bare_flags(func, [_underscore(a) for a in rest]))
    run_command(
        lambda: auto_cli(
            func,
            args=rest,
            as_positional=True,
            prog=prog,
            description=_description(func),
            formatter_class=Formatter,
        )
    )


if __name__ == "__main__":
    main()
