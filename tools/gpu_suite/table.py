"""The short summary table printed last (and written to $OUT/table.md): one markdown row per figure
of the sections that ran. A section missing from the results adds no row; one that raised adds an
ERROR row; a row builder that fails on a result of unexpected shape adds a "table error" row instead
of losing the table."""

from __future__ import annotations

import json


def _row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _latency(r):
    lat, base = r.get("latency", {}), r.get("baseline", {})
    bs1 = lat.get("bs1", {})
    if "tpot_ms" in bs1:
        yield _row("bs1 decode tok/s", f"{bs1['decode_tok_s']:.1f}", f"roofline {bs1.get('roofline_tok_s', 0):.1f} "
                   f"(copy {bs1.get('copy_bw_GBs', 0):.0f} GB/s)", f"{bs1.get('bw_ratio', 0):.1%}")
        if bs1.get("tpot_e2e_ms", 0) > 0:
            yield _row("bs1 decode tok/s, (generate - TTFT) / (n - 1)", f"{1e3 / bs1['tpot_e2e_ms']:.1f}", "", "")
    for mode in ("eager", "compile"):  # HF's TPOT is timed as ours is (per-token times)
        b = base.get(mode)
        if isinstance(b, dict) and "decode_tok_s" in b:
            if "tpot_ms" in bs1:
                yield _row(f"bs1 decode tok/s vs HF {mode}", f"{bs1['decode_tok_s']:.1f}", f"{b['decode_tok_s']:.1f}",
                           f"{bs1['decode_tok_s'] / b['decode_tok_s']:.2f}x")
            else:
                yield _row(f"HF {mode} bs1 decode tok/s", "", f"{b['decode_tok_s']:.1f}", "")
    if "bs8" in lat and "eager_bs8" in base:
        ours, theirs = lat["bs8"]["decode_tok_s"], base["eager_bs8"]["decode_tok_s"]
        yield _row("bs8 decode tok/s vs HF eager", f"{ours:.0f}", f"{theirs:.0f}", f"{ours / theirs:.1f}x")
    elif "bs8" in lat:
        yield _row("bs8 decode tok/s", f"{lat['bs8']['decode_tok_s']:.0f}", "", "")
    if "ttft_1024" in lat:
        ttft = lat["ttft_1024"]["ttft_ms"]
        yield _row("TTFT 1024 tokens (ms)", f"{ttft:.1f}", "target 35", "")
        if "eager_ttft_1024" in base:
            theirs = base["eager_ttft_1024"]["ttft_ms"]
            yield _row("TTFT 1024 vs HF eager (ms)", f"{ttft:.1f}", f"{theirs:.1f}", f"{theirs / ttft:.2f}x")
    if "startup_s" in lat:
        yield _row("engine start, dummy + graphs (s)", f"{lat['startup_s']:.1f}", "target 60", "")


def _throughput(r):
    tp = r.get("throughput", {})
    if "output_tok_s" not in tp:
        return
    yield _row("throughput output tok/s", f"{tp['output_tok_s']:.0f}", "target 12000",
               f"{tp['output_tok_s'] / 12000:.2f}")
    if "output_tok_s" in tp.get("kv_fp8", {}):
        yield _row("throughput output tok/s, fp8 KV cache", f"{tp['kv_fp8']['output_tok_s']:.0f}", "", "")
    tl = tp.get("timeline", {})
    if tl:
        yield _row("throughput: prefill s / decode s", f"{tl['prefill']['seconds']:.2f} / {tl['decode_seconds']:.2f}",
                   f"of {tp['elapsed_s']:.2f} s", "")
        yield _row("decode ms/step by seqs", ", ".join(f"{k}: {v['ms_per_step']:.2f} x{v['steps']}"
                                                       for k, v in tl["decode"].items()), "", "")


def _kv_fp8(r):
    kv8 = r.get("kv_fp8", {})
    if "bs1" in kv8:
        yield _row("fp8 KV cache: bs1 / bs8 tok/s, TTFT ms", f"{kv8['bs1']['decode_tok_s']:.1f} / "
                   f"{kv8['bs8']['decode_tok_s']:.0f}, {kv8['ttft_1024']['ttft_ms']:.1f}", "", "")
        bf16, fp8 = kv8["bs64_ctx1024_bf16_cache"]["decode_tok_s"], kv8["bs64_ctx1024"]["decode_tok_s"]
        yield _row("bs64 ctx 1024 decode tok/s: bf16 / fp8 cache", f"{bf16:.0f} / {fp8:.0f}", "", "")


def _checks(r):
    k = r.get("kernels", {})
    if "all_ok" in k:
        yield _row("kernels vs reference (bf16, 8B shapes)", "all ok" if k["all_ok"] else "FAIL", "", "")
    gr = r.get("graphs", {})
    if "exercised" in gr:
        variants = [v for v in gr.values() if isinstance(v, dict) and "equal_to_eager" in v]  # not "family"
        ok = bool(variants) and all(v["equal_to_eager"] for v in variants) and all(gr["exercised"].values())
        yield _row("graph == eager greedy (+prefix, +preempt, +fp8 KV)", "yes" if ok else "NO", "", "")
    ag = r.get("agreement", {})
    if "top1_agreement" in ag:
        yield _row("teacher-forced top-1 / cosine vs HF bf16", f"{ag['top1_agreement']:.3f} / {ag['cosine_mean']:.5f}",
                   "0.97 / 0.999", "")
    agr8 = ag.get("decode_kv_fp8")
    if agr8:
        a, o, h = agr8["ours_vs_hf_bf16"], agr8["ours_vs_hf_bf16_fp8_kv"], agr8["hf_bf16_fp8_kv_vs_hf_bf16"]
        yield _row("agreement, fp8 KV cache vs HF bf16: top-1 / cosine", f"{a['top1']:.3f} / {a['cos_mean']:.5f}",
                   "", "")
        yield _row("fp8 KV: ours vs HF over fp8 K/V / that HF vs HF bf16: top-1", f"{o['top1']:.3f} / {h['top1']:.3f}",
                   f"cosine {o['cos_mean']:.5f} / {h['cos_mean']:.5f}", "")
    for name in ("gpu_tests", "allreduce"):
        if "returncode" in r.get(name, {}):
            summary = "; ".join(r[name].get("summary", []))[-90:]
            yield _row(f"{name}: pytest on the GPU", f"rc {r[name]['returncode']}: {summary}", "", "")


def _profiles(r):
    for variant in ("graph", "graph_no_pdl"):
        prof = r.get("profile", {}).get(variant, {})
        if "wall_ms_per_token" in prof:
            kinds = ", ".join(f"{k} {v:.3f}" for k, v in prof["device_ms_per_token_by_kind"].items())
            yield _row(f"bs1 decode step ({variant}): wall / device / gaps ms", f"{prof['wall_ms_per_token']:.3f} / "
                       f"{prof['device_ms_per_token']:.3f} / {prof['gaps_ms_per_token']:.3f}", kinds, "")
    pb = r.get("profile_batch", {})
    if "wall_ms_per_step" in pb:
        yield _row("256-seq decode step: wall / device ms", f"{pb['wall_ms_per_step']:.2f} / "
                   f"{pb['device_ms_per_step']:.2f}", "", "")
    for case, row in r.get("profile_mixed", {}).items():  # 64 decodes (+ a prompt): is the step host-bound?
        if isinstance(row, dict) and "wall_ms_per_step" in row:
            enqueue, device = row.get("host_enqueue_ms_median"), row.get("device_ms_per_step")
            yield _row(f"mixed step {case}: wall / enqueue / device ms", f"{row['wall_ms_per_step']:.2f} / "
                       f"{'-' if enqueue is None else f'{enqueue:.2f}'} / {'-' if device is None else f'{device:.2f}'}",
                       "", "")


def _studies(r):
    gv = r.get("gemv", {}).get("decode_set", {})
    if gv:
        times = {k: v for k, v in gv.items() if k.endswith("_ms")}
        yield _row("decode-set GEMVs in one graph (ms)", json.dumps(times)[:90], "", "")
    for ctx in (32, 96, 160, 1024):
        a = r.get("attn_sweep", {}).get(f"ctx{ctx}")
        if a:
            b = a["best"]
            yield _row(f"bs1 decode attention ctx {ctx} (us)", f"shipped {a['shipped']['us']:.2f}",
                       f"best {b['us']:.2f} (block_n {b['block_n']}, min split {b['min_split']})", "")
    for case, row in r.get("attn_kv_dtype", {}).items():
        if isinstance(row, dict) and "us" in row.get("bf16_default", {}) and "us" in row.get("fp8_default", {}):
            best = min((k for k, v in row.items() if isinstance(v, dict) and "us" in v), key=lambda k: row[k]["us"])
            yield _row(f"decode attention {case}: bf16 / fp8 cache (us)", f"{row['bf16_default']['us']:.1f} / "
                       f"{row['fp8_default']['us']:.1f}", f"fastest {best} {row[best]['us']:.1f}", "")
    for name, v in r.get("sampler", {}).items():
        if isinstance(v, dict) and "fused_ms" in v:
            yield _row(f"sampler {name}: torch / fused (ms)", f"{v['torch_ms']:.3f} / {v['fused_ms']:.3f}",
                       f"greedy equal: {v.get('greedy_equal', '-')}", "")
    for key, v in r.get("gemm_rows", {}).items():
        if isinstance(v, dict) and "ms" in v:
            skinny = f"{v['skinny_ms']:.3f} (err {v['skinny_max_rel_err']:.1e})" if "skinny_ms" in v else "-"
            yield _row(f"decode set at {key[1:]} rows: cuBLAS / skinny GEMM (ms)", f"{v['ms']:.3f} / {skinny}", "", "")
    for key, d in r.get("skinny_sweep", {}).get("decode_set", {}).items():
        yield _row(f"decode set at {key[1:]} rows: cuBLAS / tuned skinny GEMM (ms)",
                   f"{d['cublas_ms']:.3f} / {d['skinny_tuned_ms']:.3f}", "", f"{d['ratio_cublas_over_skinny']:.3f}")


def _ab(r):
    abr = r.get("ab", {})
    for name, v in abr.get("bs1", {}).items():
        yield _row(f"ab bs1 tok/s, {name}", f"{v['decode_tok_s']:.1f}", "", "")
    for name, per in abr.get("rows", {}).items():
        figures = " / ".join(f"{per[b]['decode_tok_s']:.0f}" for b in ("bs4", "bs8", "bs16", "bs32") if b in per)
        yield _row(f"ab tok/s at bs 4 / 8 / 16 / 32, {name}", figures, "", "")
    for name, per in abr.get("switches", {}).items():
        if "error" in per:
            yield _row(f"ab switch {name}", f"ERROR {per['error'][:60]}", "", "")
        else:
            yield _row(f"ab switch {name}: tok/s", ", ".join(f"{b} {v['decode_tok_s']:.1f}" for b, v in per.items()),
                       "", "")
    tree = r.get("tree_ab", {})
    if "runs" in tree:
        b_commit = next((run["commit"][:12] for run in tree["runs"] if run["label"] == "B"), "?")
        pools = tree.get("num_kv_blocks", {})
        yield _row(f"tree_ab {tree['protocol']} {tree.get('user_engine_kw', {})}: " + " / ".join(
            f"{run['label']} {run['output_tok_s']:.0f}" for run in tree["runs"]),
            f"B {tree['b_mean']:.0f}", f"A (this checkout) {tree['a_mean']:.0f}; B = {b_commit}; KV blocks A "
            f"{pools.get('A')} B {pools.get('B')}" + (" (pools DIFFER)" if tree.get("pools_differ") else ""),
            f"{tree['b_over_a']:.4f}")


def _families(r):
    """The MoE families: bs1, throughput, TTFT and start per model; the bs1 A/B; the bs1 profile's walls."""
    for name, parts in r.get("moe_families", {}).items():
        eng = parts.get("engine", {})
        if "bs1" in eng:
            yield _row(f"{name}: bs1 tok/s / throughput / TTFT 1024 ms / start s",
                       f"{eng['bs1']['decode_tok_s']:.1f} / {eng.get('throughput', {}).get('output_tok_s', 0):.0f} / "
                       f"{eng.get('ttft_1024', {}).get('ttft_ms', 0):.1f} / {eng.get('startup_s', 0):.1f}",
                       json.dumps(eng.get("startup_phases_s", {}))[:80], "")
        prof = eng.get("profile_bs1", {})
        if "wall_ms_per_token_ctx150" in prof:
            after = prof.get("wall_ms_per_token_after_profiler")
            yield _row(f"{name}: bs1 wall ms at ctx ~40 / ~150 / after the profiler (~180)",
                       f"{prof['wall_ms_per_token']:.3f} / {prof['wall_ms_per_token_ctx150']:.3f} / "
                       + (f"{after:.3f}" if after else "-"), "", "")
        ab = parts.get("bs1_ab", {})
        if ab and all("decode_tok_s" in v for v in ab.values()):
            yield _row(f"{name}: bs1 A/B tok/s ({' / '.join(ab)})",
                       " / ".join(f"{v['decode_tok_s']:.1f}" for v in ab.values()), "", "")


def _serving(r):
    """bench serve per variant: share of offline, the client's ITL median / p99, and where its tail comes from
    (the engine's step intervals and the HTTP process's ITL, p50 / p99 from the server's histograms)."""
    def pair(hist, key):
        h = (hist or {}).get(key) or {}
        return "-" if h.get("p99_ms") is None else f"{h['p50_ms']:.1f} / {h['p99_ms']:.1f}"

    for name, v in r.get("serving", {}).get("serve_vs_offline", {}).get("variants", {}).items():
        hist = v.get("server_histograms")
        yield _row(f"serve {name}: of offline / ITL median / p99 ms",
                   f"{v['serve_over_offline']:.1%} / {v['median_itl_ms']:.2f} / {v['p99_itl_ms']:.2f}",
                   f"engine step p50 / p99 {pair(hist, 'engine_step_interval')}; "
                   f"server ITL {pair(hist, 'server_itl')}", "")


BUILDERS = (_latency, _throughput, _kv_fp8, _checks, _profiles, _studies, _ab, _families, _serving)


def render(results: dict) -> str:
    lines = ["", "| figure | ours | reference | ratio |", "|---|---|---|---|"]
    for build in BUILDERS:
        try:
            lines.extend(build(results))
        except Exception as exc:  # a result of unexpected shape: say so, keep the other rows
            lines.append(_row(build.__name__.strip("_"), f"table error: {type(exc).__name__}: {exc}"[:90], "", ""))
    for name, v in results.items():
        if isinstance(v, dict) and "error" in v:
            lines.append(_row(name, f"ERROR {v['error'][:60]}", "", ""))
    seconds = results.get("section_seconds", {})
    if seconds:
        lines.append(_row("section seconds", ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()),
                          f"total {sum(seconds.values()):.0f}", ""))
    return "\n".join(lines)
