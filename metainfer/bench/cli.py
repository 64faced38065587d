"""`metainfer bench {latency,throughput,baseline,serve}`."""

from __future__ import annotations

import importlib.util


def register(sub, add_engine_args, engine_kwargs) -> None:
    from metainfer.bench import baselines, latency, throughput

    bench = sub.add_parser("bench", help="benchmarks (JSON out with GPU name and versions)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for module in (latency, throughput, baselines):
        module.add_parser(bench_sub, add_engine_args)
    if importlib.util.find_spec("metainfer.bench.serve") is not None:
        from metainfer.bench import serve
        serve.add_serve_bench_parser(bench_sub)
    bench.set_defaults(func=lambda args: _run(args, engine_kwargs))


def _run(args, engine_kwargs) -> int:
    if args.bench_command == "serve":
        from metainfer.bench import serve
        record = serve.main(args)
        return 0 if record and record.get("completed") else 1
    args.bench_func(args, engine_kwargs)
    return 0
