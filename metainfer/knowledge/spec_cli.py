"""`metainfer spec MODEL`: the model-spec report (knowledge/spec_report.py) on the command line, so a split
can be checked and its memory planned from config.json or a GGUF header before any weight is fetched."""

from __future__ import annotations

import sys


def add_parser(sub) -> None:
    from metainfer.config import KV_CACHE_DTYPES
    from metainfer.entrypoints.cli import float_above

    p = sub.add_parser("spec", help="per-rank facts of a model (shapes, bytes, constraints) from its config alone",
                       description=__doc__)
    p.add_argument("model", nargs="?", default=None,
                   help="model folder with config.json, a config.json file, or a .gguf file (default: the embedded "
                        "SmolLM2 GGUF)")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="tensor-parallel size the shapes and bytes are given for (default 1)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the whole report as JSON on stdout")
    out.add_argument("-o", "--output", default=None,
                     help="write the report to this file: JSON if it ends in .json, else YAML (e.g. model_spec.yaml)")
    p.add_argument("--gpu-memory-gib", type=float_above(0), default=None,
                   help="GPU memory per rank in GiB, > 0: adds `memory` (KV gets G x 2^30 x 0.9 minus the rank's "
                        "weights)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", *KV_CACHE_DTYPES),
                   help="KV cache dtype: auto (the --dtype) or fp8 / fp8_e4m3 (1 byte a value; default auto)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="weight dtype the bytes are counted in (default bfloat16; DeepSeek's routers stay fp32)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="sequence length the memory plan counts sequences of (default: the config's "
                        "max_position_embeddings)")
    p.set_defaults(func=cmd_spec)


def cmd_spec(args) -> int:
    from metainfer.config import ConfigError
    from metainfer.knowledge.cli import emit
    from metainfer.knowledge.spec_report import build_report, load_config, to_json, to_yaml

    model = args.model
    if model is None:
        from metainfer.entrypoints.cli import default_model_path

        model = default_model_path()
    if args.tp < 1:  # a bad option value (exit 2); a tp the model cannot be split by is a violation (exit 1)
        print(f"metainfer spec: error: --tp must be >= 1; got {args.tp}", file=sys.stderr)
        return 2
    if args.output and not args.output.endswith((".yaml", ".yml", ".json")):
        print(f"metainfer spec: error: -o {args.output}: the file name must end in .yaml, .yml or .json (the format)",
              file=sys.stderr)
        return 2
    if args.max_model_len is not None and args.max_model_len < 1:
        print(f"metainfer spec: error: --max-model-len must be >= 1; got {args.max_model_len}", file=sys.stderr)
        return 2
    try:
        report = build_report(load_config(model), tp=args.tp, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                              gpu_memory_gib=args.gpu_memory_gib, max_model_len=args.max_model_len)
    except ConfigError as err:
        print(f"metainfer spec: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        emit(to_json(report))
    elif args.output:
        try:
            with open(args.output, "w") as f:
                f.write(to_json(report) + "\n" if args.output.endswith(".json") else to_yaml(report))
        except OSError as err:  # a missing folder, a folder given as the file: one line
            print(f"metainfer spec: error: -o {args.output}: {err.strerror or err}", file=sys.stderr)
            return 2
        emit(f"wrote {args.output}")
    else:
        emit(summary(report, args.tp))
    if report["violations"]:  # one line, every violated node in it
        print("metainfer spec: error: " + "; ".join(f"{v['node']}: {v['message']}" for v in report["violations"]),
              file=sys.stderr)
    return 1 if report["violations"] else 0


def summary(report: dict, tp: int) -> str:
    """A few readable lines of the report; the shapes in the compressed view (repeated layers and experts as
    {i} / {e} templates; --json or -o for every name)."""
    from metainfer.knowledge.spec_report import compress_shapes

    lines = [f"architecture: {report['architecture']} (family {report['family']}), tp={tp}"]
    feats = report["features"]
    if feats:
        att, moe = feats["attention"], feats["moe"]
        lines.append(f"attention: {att['kind']}, {att['num_heads']} heads"
                     + (f", {att['num_kv_heads']} KV heads" if att["kind"] == "GQA" else
                        f", latent {att['kv_lora_rank']} + rope {att['qk_rope_head_dim']}"))
        lines.append(f"rope: {feats['rope']['type']}, theta {feats['rope']['theta']}")
        if moe:
            lines.append(f"moe: {moe['num_experts']} experts, top {moe['top_k']}, {moe['num_shared_experts']} shared, "
                         f"{moe['num_moe_layers']} MoE layers")
    if report["params_total"] is not None:
        lines.append(f"parameters: {report['params_total']:,}")
    if report["per_rank_shapes"] is not None:
        lines.append(f"weights per rank: {report['weight_bytes_per_rank']:,} bytes")
        lines.append(f"per-rank shapes ({len(report['per_rank_shapes']):,} parameters; compressed view):")
        for name, value in compress_shapes({k: tuple(v) for k, v in report["per_rank_shapes"].items()}).items():
            shape = value["shape"] if isinstance(value, dict) else value
            ranges = "".join(f" {key}={','.join(f'{a}-{b}' if a != b else str(a) for a, b in value[key])}"
                             for key in ("i", "e") if isinstance(value, dict) and key in value)
            lines.append(f"  {name} {list(shape)}{ranges}")
    elif report["violations"]:  # the split-independent facts above hold; say why the per-rank ones are missing
        lines.append(f"per-rank facts: none at tp={tp} (violated: "
                     f"{', '.join(v['node'] for v in report['violations'])}; the error below)")
    if report["kv_bytes_per_token"] is not None:
        lines.append(f"KV cache per token per rank: {report['kv_bytes_per_token']:,} bytes")
    if report["memory"]:
        m = report["memory"]
        source = "the config's max_position_embeddings" if m["max_model_len_from"] == "max_position_embeddings" \
            else "--max-model-len"
        lines.append(f"memory: {m['gpu_memory_gib']} GiB x {m['gpu_memory_utilization']} = "
                     f"{m['budget_bytes']:,} bytes; less the weights, {m['kv_bytes_available']:,} bytes of KV "
                     f"= {m['kv_tokens']:,} KV tokens = {m['max_sequences_at_max_model_len']} sequences of "
                     f"max_model_len {m['max_model_len']:,} tokens ({source}); not counted: {m['not_counted']}")
    return "\n".join(lines)
