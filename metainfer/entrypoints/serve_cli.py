"""`metainfer serve`: the OpenAI-compatible server (see the openai/ package); fastapi and uvicorn are
imported only when the command runs, so the CLI works without the serve extra (and says which extra
to install when they are missing, before the model loads)."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
import sys

SERVER_PACKAGES = ("fastapi", "uvicorn")


def register(subparsers, add_engine_args, engine_kwargs) -> None:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics)",
        description="OpenAI-compatible HTTP server. All live requests share one continuously batched engine. "
                    "SIGTERM / SIGINT: new requests get 503, those in flight may finish for --shutdown-timeout "
                    "seconds, the rest end with a final error event; the engine is closed and the exit status is 0.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="model path (same as --model)")
    add_engine_args(p, serving=True)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("METAINFER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize and the API docs; "
                        "/health, /version and /metrics stay open (default: $METAINFER_API_KEY, else none)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use as `model` (default: the model folder's or .gguf file's name)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="answer 503 when this many requests are waiting for their first token (default: no cap)")
    p.add_argument("--max-request-mb", type=float, default=32.0,
                   help="answer 413 to a POST body over this many MiB, before it is parsed (default 32; a "
                        "128k-token prompt is ~1 MB)")
    p.add_argument("--no-docs", action="store_true", help="do not serve /docs, /redoc and /openapi.json")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a request bring its own chat template (chat_template_kwargs.chat_template); off by "
                        "default: a template is code the server runs, so any client could stall it")
    p.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="seconds requests in flight may run on after SIGTERM / SIGINT (default 5)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server log level (default info)")
    p.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    p.set_defaults(func=lambda args: cmd_serve(args, engine_kwargs))


def missing_server_packages() -> list[str]:
    return [name for name in SERVER_PACKAGES if importlib.util.find_spec(name) is None]


def check_engine_options(kwargs: dict) -> None:
    """Every engine option checked here, before the engine process starts (a bad one is one line, as fast as
    `generate` refuses it): the engine's own checks (llm_engine.resolve_config) on the model's spec, with a CUDA
    device checked for presence only and the rest on the CPU, so this process, which only serves HTTP, makes no
    CUDA context (its memory would come out of the engine's KV pool). The GPU-only checks (fp8 needs compute
    capability 8.9) stay the engine process's."""
    from metainfer.config import EngineConfig
    from metainfer.config.engine_config import resolve_device
    from metainfer.engine.llm_engine import resolve_config

    device = kwargs.get("device", "auto")
    on_cuda = device != "mlx" and resolve_device(device).type == "cuda"  # a device this machine lacks: refused
    resolve_config(EngineConfig(**({**kwargs, "device": "cpu"} if on_cuda else kwargs)))


def cmd_serve(args: argparse.Namespace, engine_kwargs) -> int:
    from metainfer.entrypoints.cli import usage_error

    missing = missing_server_packages()
    if missing:
        raise SystemExit(f"metainfer: error: serve needs {' and '.join(missing)}: "
                         "pip install 'metainfer[serve]'")
    if args.model_tag and args.model and args.model_tag != args.model:
        usage_error("give the model either as MODEL or as --model, not both")
    args.model = args.model or args.model_tag
    if args.max_queued_requests is not None and args.max_queued_requests < 1:
        usage_error(f"--max-queued-requests: must be >= 1 (default: no cap), got {args.max_queued_requests}")
    if not 0 < args.max_request_mb < math.inf:
        usage_error(f"--max-request-mb: must be > 0 and finite, got {args.max_request_mb}")
    if not 0 <= args.shutdown_timeout < math.inf:
        usage_error(f"--shutdown-timeout: must be >= 0 and finite, got {args.shutdown_timeout}")
    if not 0 <= args.port <= 65535:
        usage_error(f"--port: must be in [0, 65535], got {args.port}")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from metainfer import LLM
    from metainfer.entrypoints.openai.api_server import default_served_name, serve
    from metainfer.worker.tp.launched import follow_rank0

    kwargs = engine_kwargs(args)
    names = args.served_model_name or [default_served_name(kwargs["model"])]
    options = dict(served_model_names=names, host=args.host, port=args.port, api_key=args.api_key,
                   max_queued_requests=args.max_queued_requests, log_level=args.log_level,
                   access_log=not args.no_access_log, docs=not args.no_docs, shutdown_timeout=args.shutdown_timeout,
                   trust_request_chat_template=args.trust_request_chat_template, max_request_mb=args.max_request_mb)
    if kwargs.get("distributed_executor_backend") != "external_launcher":
        from metainfer.entrypoints.openai.engine_core import EngineStartError

        check_engine_options(kwargs)

        try:
            code = serve(kwargs, **options)  # the engine in its own process, built, warmed up and closed by serve
        except EngineStartError as err:  # its traceback, if any, was logged by the engine process
            print(f"metainfer: error: {err}", file=sys.stderr)
            return 1
        if code == 0:
            logging.getLogger("metainfer.server").info("engine closed; exiting")
        else:
            logging.getLogger("metainfer.server").warning("the engine process ended with code %s; exiting", code)
        return 0
    # under torchrun this process is a rank: the engine cannot move to another process, so rank 0 serves it from a
    # thread and the others replay its steps
    llm = LLM(**kwargs)
    if follow_rank0(llm):
        return 0
    try:
        serve(llm, **options)
    finally:
        llm.close()
        logging.getLogger("metainfer.server").info("engine closed; exiting")
    return 0
