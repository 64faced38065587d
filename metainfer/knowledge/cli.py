"""The knowledge package's subcommands of `metainfer` (spec, blueprint, gate), registered like serve and bench:
each command's module is imported when it runs, so `metainfer --help` stays light."""

from __future__ import annotations

import importlib
import importlib.util

COMMAND_MODULES = ("metainfer.knowledge.spec_cli", "metainfer.knowledge.blueprint_cli", "metainfer.knowledge.gate_cli")


def register(sub, add_engine_args, engine_kwargs) -> None:
    for module in COMMAND_MODULES:
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module).add_parser(sub)
