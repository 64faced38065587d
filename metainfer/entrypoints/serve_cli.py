"""`metainfer serve`: the OpenAI-compatible server (see the openai/ package); fastapi and uvicorn are
imported only when the command runs, so the CLI works without the serve extra."""

from __future__ import annotations

import argparse
import logging
import os


def register(subparsers, add_engine_args, engine_kwargs) -> None:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics)",
        description="OpenAI-compatible HTTP server. All live requests share one continuously batched engine.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="model path (same as --model)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("METAINFER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $METAINFER_API_KEY, else none)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use as `model` (default: the model path)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="answer 503 when this many requests are waiting for their first token (default: no cap)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    p.set_defaults(func=lambda args: cmd_serve(args, engine_kwargs))


def cmd_serve(args: argparse.Namespace, engine_kwargs) -> int:
    from metainfer import LLM
    from metainfer.entrypoints.openai.api_server import serve

    if args.model_tag and args.model and args.model_tag != args.model:
        raise SystemExit("give the model either as MODEL or as --model, not both")
    args.model = args.model or args.model_tag
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        raise SystemExit("--max-queued-requests must be >= 0")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kwargs = engine_kwargs(args)
    names = args.served_model_name or [args.model or kwargs["model"]]
    llm = LLM(**kwargs)
    try:
        serve(llm, served_model_names=names, host=args.host, port=args.port, api_key=args.api_key,
              max_queued_requests=args.max_queued_requests, log_level=args.log_level,
              access_log=not args.no_access_log)
    finally:
        llm.close()
    return 0
