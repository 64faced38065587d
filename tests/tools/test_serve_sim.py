"""tools/serve_sim: bench serve's closed loop through the engine's scheduler, priced per step. Checked against
arithmetic done here, not the tool's own numbers: with every request waiting at once and no mixed cap (offline),
each wave of `concurrency` requests runs its decode steps after its prompts' prefill steps; under the 256-token
mixed cap the first wave's last prompt waits at least as many steps as its 64 prompts need at 256 tokens a step;
and the cap bounds every mixed step's price, so the ITL p99 sits below one decode step plus the cap's prompt tokens."""

from __future__ import annotations

import pytest

from tools.serve_sim import MIXED_PROMPT_MS, decode_ms, simulate


@pytest.fixture(scope="module")
def runs():
    kw = dict(num_prompts=128, input_len=512, output_len=64, concurrency=32)
    return simulate(offline=True, **kw), simulate(mixed_cap=256, **kw), kw


def test_offline_runs_each_wave_to_its_length(runs):
    offline, _, kw = runs
    waves = kw["num_prompts"] // kw["concurrency"]
    prefill_steps = -(-kw["concurrency"] * kw["input_len"] // 8192)  # 8,192 prompt tokens a step
    # each wave: its prompts' steps (the first token comes with a prompt's last chunk), output_len - 1 decode steps
    # more, and at most one step more where the budget's decode rows push a prompt's last chunk over
    assert waves * (prefill_steps + kw["output_len"] - 1) <= offline["steps"]
    assert offline["steps"] <= waves * (prefill_steps + kw["output_len"])
    assert offline["output_tok_s"] == pytest.approx(kw["num_prompts"] * kw["output_len"] / offline["seconds"], rel=1e-3)


def test_the_mixed_cap_spreads_the_first_wave(runs):
    offline, capped, kw = runs
    # after the first step (which runs without decode rows) each step admits at most 256 prompt tokens
    ramp_steps = ((kw["concurrency"] - 1) * kw["input_len"]) // 256
    assert capped["ttft_max_ms"] >= ramp_steps * decode_ms(1)
    assert capped["steps"] > offline["steps"]
    assert capped["itl_p99_ms"] <= decode_ms(kw["concurrency"]) + 256 * MIXED_PROMPT_MS + 1e-6
