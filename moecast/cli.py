"""The ``moecast`` command: one table maps each subcommand to a plain typed function.

Like litgpt's CLI, the functions live in the stage packages and jsonargparse turns
their signatures and docstrings into options (and ``--config`` YAML files). Only the
chosen subcommand's module is imported, so ``moecast --help`` stays fast.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

# name -> "module:function" (a nested dict is a command group, e.g. `moecast traces info`)
COMMANDS: dict[str, str | dict[str, str]] = {
    "build-tiny": "moecast.collect.tiny:build_tiny",
    "collect": "moecast.collect.commands:collect",
    "import": {"moe-beyond": "moecast.collect.moe_beyond:import_moe_beyond"},
    "traces": {
        "info": "moecast.collect.info:traces_info",
        "merge": "moecast.collect.commands:merge_traces",
    },
    "train": {
        "llapor": "moecast.train.llapor:fit_llapor",
        "sequence": "moecast.train.sequence:fit_sequence",
        "eap": "moecast.train.eap:fit_eap",
        "eam": "moecast.train.eam:fit_eam",
        "cascade": "moecast.train.cascade:fit_cascade",
    },
    "predictors": {
        "eval": "moecast.predictors.commands:evaluate",
        "remember": "moecast.predictors.commands:remember",
        "calibrate": "moecast.predictors.commands:calibrate",
    },
    "profile": "moecast.runtime.profile.commands:profile",
    "replay": "moecast.runtime.replay.commands:replay",
    "compare": "moecast.runtime.replay.commands:compare",
    "run": "moecast.runtime.live.commands:run",
    "eval-accuracy": "moecast.runtime.live.commands:eval_accuracy",
    "demo": "moecast.demo:demo",
}
# Groups whose required arguments are options too (`moecast train llapor --traces T --out C`)
NAMED_ONLY = {"train"}
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


def _list_item(hint: Any) -> type | None:
    """The item type of a list-like type hint (``list[str]``, ``Sequence[float] | None``), else None."""
    import collections.abc
    import typing

    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        # None, or one item as well as a list (``str | list[str]``), is what a list of words covers
        lists = [a for a in args if a is not type(None) and _list_item(a) is not None]
        rest = [a for a in args if a is not type(None) and a not in lists]
        if len(lists) != 1 or any(a is not _list_item(lists[0]) for a in rest):
            return None
        return _list_item(lists[0])
    origin = typing.get_origin(hint)
    if origin in (list, collections.abc.Sequence) and len(args) == 1:
        return args[0]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    return None


def _parser_class() -> type:
    """jsonargparse's parser, as moecast's commands are used (its own parser class, no argv editing):

    - an option is also accepted with dashes (``--max-requests`` for ``--max_requests``);
    - a bool option alone means true (``--json``), as users expect of flags;
    - a list takes its items as words (``--policies lru smoe``, ``moecast traces merge A B --out C``);
      a YAML config gives it as a list;
    - a wrong argument is one line naming the command's ``--help``, like moecast's other errors.
    """
    import typing

    from jsonargparse import ArgumentParser

    from moecast.errors import InputError

    class Parser(ArgumentParser):
        def add_argument(self, *args: Any, **kwargs: Any) -> Any:
            item = _list_item(getattr(kwargs.get("action"), "_typehint", None))
            if kwargs.get("type") is bool and "action" not in kwargs:
                kwargs.update(nargs="?", const=True)
            elif item is not None:
                del kwargs["action"]
                kwargs.update(type=item, nargs="+")
                if isinstance(kwargs.get("default"), tuple):  # a signature's immutable default
                    kwargs["default"] = list(kwargs["default"])
            return super().add_argument(*args, **kwargs)

        def _parse_optional(self, arg_string: str) -> Any:
            name, eq, value = arg_string.partition("=")
            if name.startswith("--") and "-" in name[2:] and name not in self._option_string_actions:
                underscored = "--" + name[2:].replace("-", "_")
                if underscored in self._option_string_actions:
                    arg_string = underscored + eq + value
            return super()._parse_optional(arg_string)

        def error(self, message: str, ex: Exception | None = None) -> typing.NoReturn:
            detail = " ".join(str(message).split())
            raise InputError(f"{self.prog}: {detail} (see `{self.prog} --help`)") from ex

    return Parser


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
    from moecast.errors import run_command

    run_command(lambda: run(argv))


def run(argv: list[str]) -> Any:
    """Run one ``moecast`` command line and return what its function returns; errors are raised,
    not printed (:func:`main` prints a user error as one line)."""
    from moecast.errors import InputError

    for alias, real in ALIASES.items():
        if tuple(argv[: len(alias)]) == alias:
            argv = list(real) + argv[len(alias) :]
    name, rest = argv[0], argv[1:]
    target = COMMANDS.get(name)
    if target is None:
        raise InputError(f"unknown command {name!r}; run `moecast --help` for the list")
    prog = f"moecast {name}"
    if isinstance(target, dict):
        if rest and rest[0] in ("-h", "--help"):
            print("\n".join(f"  moecast {name} {sub:<14}{_describe(t)}" for sub, t in target.items()))
            return None
        if not rest or rest[0] not in target:
            raise InputError(
                f"choose a `moecast {name}` command: {', '.join(target)} (e.g. `moecast {name} {next(iter(target))} --help`)"
            )
        prog += f" {rest[0]}"
        target, rest = target[rest[0]], rest[1:]
    func = _resolve(target)
    help_doc = getattr(func, "help_doc", None)
    if help_doc is not None and ("-h" in rest or "--help" in rest):
        # a help that lists a registry's entries (predictors eval: the kinds it builds) is made when
        # shown, so entries registered after its module was imported are in it
        func.__doc__ = help_doc()
    import argparse

    from jsonargparse import DefaultHelpFormatter, auto_cli

    class Formatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
        """jsonargparse's, with the description's paragraphs and lists kept as written."""

    from moecast.errors import MoecastError, as_flags

    try:
        return auto_cli(
            func,
            args=rest,
            as_positional=name not in NAMED_ONLY,
            parser_class=_parser_class(),
            prog=prog,
            description=_description(func),
            formatter_class=Formatter,
        )
    except MoecastError as exc:  # the library names keywords; the command's user types flags
        import inspect

        exc.args = (as_flags(str(exc), inspect.signature(func).parameters), *exc.args[1:])
        raise


if __name__ == "__main__":
    main()
