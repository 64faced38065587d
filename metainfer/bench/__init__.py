"""Benchmarks: latency, throughput, HF baselines, serving."""
