"""`metainfer blueprint [--json]` prints the blueprint; `metainfer blueprint check` runs every drift check
(metainfer/knowledge/blueprint.py) and exits 1 on any error."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("blueprint", help="print the engine's blueprint, or check it against the code",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", nargs="?", choices=("check",), help="check: schema, refs, tests and formulas")
    p.add_argument("--json", action="store_true", help="print the whole document as JSON")
    p.add_argument("--file", default=None, help="a blueprint file other than the packaged one")
    p.set_defaults(func=run)


def _summary(doc: dict) -> str:
    lines = [doc.get("about", ""), ""]
    for category in doc["categories"]:
        nodes = [n for n in doc["nodes"] if n["category"] == category]
        lines.append(f"{category} ({len(nodes)})")
        lines += [f"  {n['id']:<40} {n['phase']:<4} {n['title']}" for n in nodes]
    lines.append(f"phases: {', '.join(p['id'] + ' ' + p['title'] for p in doc['phases'])}")
    return "\n".join(lines)


def run(args) -> int:
    from metainfer.knowledge.blueprint import (
        BLUEPRINT_PATH,
        CONFIG_VARIANTS,
        TP_SIZES,
        check_blueprint,
        load_blueprint,
    )
    from metainfer.knowledge.cli import emit

    doc = load_blueprint(args.file or BLUEPRINT_PATH)
    if args.action != "check":
        emit(json.dumps(doc, indent=1) if args.json else _summary(doc))
        return 0
    result = check_blueprint(doc)
    if args.json:
        emit(json.dumps(result, indent=1))
    for error in result["errors"]:
        print(f"drift: {error}", file=sys.stderr)
    if not args.json:
        state = "ok" if not result["errors"] else f"{len(result['errors'])} error(s)"
        skipped = result["splits_skipped"]
        emit(f"blueprint check: {state}: {result['nodes']} nodes, {result['shapes_compared']} per-rank shapes "
             f"compared (3 families and {len(CONFIG_VARIANTS)} variants x tp {', '.join(map(str, TP_SIZES))}); "
             f"{len(skipped)} split(s) skipped, refused by the engine as their constraint node's requires says"
             + "".join(f"\n  skipped: {s}" for s in skipped))
    return 1 if result["errors"] else 0
