"""The knowledge package's subcommands of `metainfer` (spec, blueprint, gate), registered like serve and bench:
each command's module is imported when it runs, so `metainfer --help` stays light."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

COMMAND_MODULES = ("metainfer.knowledge.spec_cli", "metainfer.knowledge.blueprint_cli", "metainfer.knowledge.gate_cli")


def register(sub, add_engine_args, engine_kwargs) -> None:
    for module in COMMAND_MODULES:
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module).add_parser(sub)


def emit(text: str) -> None:
    """Print a line of a command's output; a reader that closed early (`metainfer spec ... | head -1`) ends the
    output quietly: stdout goes to /dev/null, so neither this write nor the flush at exit raises
    BrokenPipeError, and the command still finishes and returns its own exit status."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
