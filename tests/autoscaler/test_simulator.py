"""The pool simulator's arithmetic on tiny traces, and the simulate command."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fleetserve.autoscaler.policy import KVCachePolicy, QueueDepthPolicy
from fleetserve.platform.config import AutoscalingConfig
from fleetserve.autoscaler.simulator import SLO, simulate, step_duration
from fleetserve.platform.config import ReplicaProfile
from fleetserve.platform.output_lengths import NUM_OUTPUT_LENGTH_BUCKETS, bucket_index
from fleetserve.autoscaler.traces import TraceRequest, bursts, synthetic
from fleetserve.cli.main import app

PROFILE = ReplicaProfile(kv_capacity_tokens=1000, prefill_tokens_per_s=4000, decode_step_base_s=0.01,
                         decode_step_per_seq_s=0.001, max_num_seqs=8, max_num_batched_tokens=2048, startup_s=10)


def fixed(replicas: int):
    return KVCachePolicy(AutoscalingConfig(min_replicas=replicas, max_replicas=replicas))


def test_one_request_prefills_then_decodes_one_token_per_step():
    result = simulate([TraceRequest(0.0, prompt_tokens=600, output_tokens=3)], fixed(1), PROFILE)
    # Step 1 prefills 600 tokens: 0.01 + 600 / 4000 = 0.16 s, and yields the first token.
    assert result.ttfts[0] == pytest.approx(0.16)
    # Steps 2 and 3 decode one sequence each: 0.01 + 0.001 = 0.011 s; TPOT = 0.022 / 2.
    assert result.tpots[0] == pytest.approx(0.011)


def test_miss_share_is_per_window_of_arrivals():
    import numpy as np

    # Each request: a 600-token prefill of 0.16 s (as above); one replica serves them one at a time, so the
    # third, arriving with two ahead of it, waits 0.32 s and misses a 0.4 s TTFT target (0.48 s); the fourth,
    # alone 2 s later, meets it.
    trace = [TraceRequest(0.0, 600, 1), TraceRequest(0.0, 600, 1), TraceRequest(0.0, 600, 1), TraceRequest(2.0, 600, 1)]
    result = simulate(trace, fixed(1), PROFILE.model_copy(update={"max_num_batched_tokens": 600}),
                      SLO(ttft_s=0.4, tpot_s=1.0))
    assert result.met_slo.tolist() == [True, True, False, True]
    # Windows [0, 1), [1, 2), [2, 3): 1 of 3 missed, no arrivals, 0 of 1.
    share = result.miss_share(np.array([0.0, 1.0, 2.0, 3.0]))
    assert share[0] == pytest.approx(1 / 3) and np.isnan(share[1]) and share[2] == 0.0


class Recording:
    """Holds one replica and keeps every observation."""

    def __init__(self) -> None:
        self.observations = []

    def decide(self, observation):
        self.observations.append(observation)
        return fixed(1).decide(observation)


def test_replicas_report_their_finished_requests_by_output_length():
    policy = Recording()
    # The last request keeps the run going past the first decision, at 1 s.
    trace = [TraceRequest(0.0, 100, 3), TraceRequest(0.0, 100, 3), TraceRequest(0.0, 100, 20), TraceRequest(1.5, 100, 3)]
    simulate(trace, policy, PROFILE, decision_interval_s=1.0)
    (replica,) = policy.observations[0].replicas
    rates = replica.finished_per_s_by_length
    # The first three finish within the first second (a 0.085 s prefill, then 19 decode steps of 0.011-0.013 s): over
    # that 1 s interval, 2/s with 3 tokens and 1/s with 20.
    assert (rates[bucket_index(3)], rates[bucket_index(20)], sum(rates)) == (2.0, 1.0, 3.0)
    assert len(rates) == NUM_OUTPUT_LENGTH_BUCKETS


def test_decode_steps_slow_with_the_kv_their_sequences_hold():
    profile = PROFILE.model_copy(update={"decode_step_per_kv_token_s": 1e-4})
    result = simulate([TraceRequest(0.0, prompt_tokens=600, output_tokens=3)], fixed(1), profile)
    # Step 1 prefills 600 tokens, no decode: 0.01 + 600 / 4000 = 0.16 s. Step 2 decodes the sequence holding
    # 600 tokens of KV: 0.01 + 0.001 + 600 x 1e-4 = 0.071 s; step 3 holds 601: 0.0711 s. TPOT = 0.1421 / 2.
    assert result.ttfts[0] == pytest.approx(0.16)
    assert result.tpots[0] == pytest.approx(0.07105)


def test_step_duration_adds_base_batch_context_and_prefill():
    profile = PROFILE.model_copy(update={"decode_step_per_kv_token_s": 1e-6})
    # 0.01 + 4 x 0.001 + 2,000 x 1e-6 + 500 / 4,000 = 0.01 + 0.004 + 0.002 + 0.125.
    assert step_duration(profile, 4, 2000, 500) == pytest.approx(0.141)


def test_kv_exhaustion_preempts_the_newest_request_which_recomputes_after():
    trace = [TraceRequest(0.0, 500, 100), TraceRequest(0.0, 500, 100)]  # 600 + 600 > 1000 tokens of KV
    result = simulate(trace, fixed(1), PROFILE)
    # Step 1 prefills both prompts (1000 tokens fit the budget and exactly fill the KV): 0.01 + 1000/4000
    # = 0.26 s, and both get their first token.
    assert list(result.ttfts) == pytest.approx([0.26, 0.26])
    # Step 2: the first needs one more token, none is free: the second (newest) is preempted, freeing 500.
    # The first then decodes alone; the second's recompute (500 + 1 tokens) never fits beside it (1000 -
    # 501 = 499 free), so it waits until the first finishes after 99 decode steps of 0.011 s.
    first_done = 0.26 + 99 * 0.011
    assert result.tpots[0] == pytest.approx(0.011)
    # The second recomputes 501 tokens (0.01 + 501/4000 = 0.13525 s, yielding its 2nd token), then
    # decodes its other 98 tokens: TPOT = (done - first token) / 99.
    second_done = first_done + 0.13525 + 98 * 0.011
    assert result.tpots[1] == pytest.approx((second_done - 0.26) / 99)
    assert result.num_preemptions == 1 and result.num_unfinished == 0


def test_replica_seconds_count_every_replica_for_the_whole_run():
    trace = [TraceRequest(float(t), 100, 10) for t in range(10)]
    result = simulate(trace, fixed(2), PROFILE, initial_replicas=2, drain_s=1.0)
    # The last request arrives at 9 s and takes 0.035 s of prefill plus 9 decode steps of 0.011 s:
    # done at 9.134 s, so the run ends at the next 0.05 s tick, 9.15 s; 2 replicas x 9.15 s = 18.3.
    assert result.replica_seconds == pytest.approx(18.3, abs=0.01)
    assert result.ttft_attainment == 1.0 and result.num_unfinished == 0


def test_kv_policy_adds_replicas_for_a_burst_and_removes_them_after():
    trace = bursts(420, base_rate=0.5, burst_rate=20, burst_every_s=150, burst_length_s=30,
                   prompt_tokens=200, output_tokens=100, seed=1)
    policy = KVCachePolicy(AutoscalingConfig(window_s=5, scale_down_cooldown_s=20, min_replicas=1, max_replicas=6,
                                             max_step_up=3, downscale_stabilization_s=0))
    result = simulate(trace, policy, PROFILE, SLO(ttft_s=5.0))
    replicas = [point.num_replicas for point in result.timeline]
    # Bursts at 120-150 s and 270-300 s, then 120 s of base load to scale back down.
    assert max(replicas) > 1 and replicas[-1] < max(replicas)
    reasons = {point.decision.reason for point in result.timeline}
    assert reasons & {"kv_high", "queue"} and "kv_low" in reasons


def test_requests_larger_than_a_replica_are_refused_up_front():
    with pytest.raises(ValueError, match="need more KV than one replica holds"):
        simulate([TraceRequest(0.0, 900, 200)], fixed(1), PROFILE)


def test_synthetic_specs_and_errors():
    assert len(synthetic("ramp:60:1:3")) > 0
    assert len(synthetic("day:120:1:5")) > 0
    with pytest.raises(ValueError, match="unknown trace spec"):
        synthetic("zigzag:60:1")


def test_simulate_command_compares_policies_and_writes_plot(tmp_path):
    kv = tmp_path / "kv.yaml"
    kv.write_text("policy: kv_cache\nwindow_s: 5\nmax_replicas: 4\n")
    ray_default = tmp_path / "ray.yaml"
    ray_default.write_text("policy: ray_default\ntarget_ongoing_requests: 4\n")
    result = CliRunner().invoke(app, ["autoscale", "simulate", "--trace", "bursts:120:1:8", "--policy", str(kv),
                                      "--compare", str(ray_default), "--plot", str(tmp_path / "t.png"),
                                      "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "r.json").read_text())
    assert set(summary["results"]) == {"kv", "ray"}
    assert (tmp_path / "t.png").stat().st_size > 20_000
    bad = tmp_path / "bad.yaml"
    bad.write_text("policy: hpa\n")
    result = CliRunner().invoke(app, ["autoscale", "simulate", "--trace", "ramp:10:1:2", "--policy", str(bad)])
    assert result.exit_code == 2 and "policy: Input should be 'kv_cache', 'ray_default', 'queue_depth' or 'slo'" in result.output
    assert QueueDepthPolicy().config.target_queue_per_replica == 4.0


def test_simulate_command_replays_a_recorded_trace_csv_faster(tmp_path):
    trace = tmp_path / "trace.csv"
    # 40 requests, one every 2 s: 78 s of trace, 39 s at --rate-scale 2.
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     + "".join(f"{2 * i},{200},{20}\n" for i in range(40)))
    slo = tmp_path / "slo.yaml"
    slo.write_text("policy: slo\nttft_p99_s: 2\ntpot_p99_s: 0.05\nmax_replicas: 4\n")
    profile = tmp_path / "profile.yaml"
    profile.write_text("kv_capacity_tokens: 4000\nprefill_tokens_per_s: 2000\nstartup_s: 5\n")
    result = CliRunner().invoke(app, ["autoscale", "simulate", "--trace", str(trace), "--rate-scale", "2",
                                      "--policy", str(slo), "--profile", str(profile), "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "r.json").read_text())
    # The slo block took the simulated replica's profile, and served every one of the light requests in time.
    assert summary["profile"]["kv_capacity_tokens"] == 4000
    assert summary["results"]["slo"]["slo_attainment"] == 1.0 and summary["results"]["slo"]["num_unfinished"] == 0
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1,x,3\n")
    result = CliRunner().invoke(app, ["autoscale", "simulate", "--trace", str(bad), "--policy", str(slo)])
    assert result.exit_code == 2 and "bad.csv:2: expected a timestamp and two token counts" in result.output
    # A recorded trace is replayed as recorded: a seed would change nothing, so it is refused.
    result = CliRunner().invoke(app, ["autoscale", "simulate", "--trace", str(trace), "--seed", "3",
                                      "--policy", str(slo)])
    assert result.exit_code == 2
    assert "--seed draws synthetic traces only; " in result.output and "drop --seed" in " ".join(result.output.split())


def test_simulate_command_judges_an_slo_policy_by_its_own_targets_and_profile(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(f"{i},100,10\n" for i in range(20)))
    slo = tmp_path / "slo.yaml"
    slo.write_text("policy: slo\nttft_p99_s: 1.5\ntpot_p99_s: 0.04\nmax_replicas: 2\n"
                   "profile: {kv_capacity_tokens: 3000, prefill_tokens_per_s: 1500, startup_s: 7}\n")
    ray_default = tmp_path / "ray.yaml"
    ray_default.write_text("policy: ray_default\n")
    result = CliRunner().invoke(app, ["autoscale", "simulate", "--trace", str(trace), "--policy", str(ray_default),
                                      "--compare", str(slo), "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "r.json").read_text())
    # Both policies ran on the slo block's replica and were judged by its targets, not the built-in 2 s / 0.1 s.
    assert summary["slo"] == {"ttft_s": 1.5, "tpot_s": 0.04}
    assert summary["profile"] == ReplicaProfile(kv_capacity_tokens=3000, prefill_tokens_per_s=1500,
                                                startup_s=7).model_dump()
    assert "replicas simulated with slo.yaml's profile; SLOs TTFT 1.5 s, TPOT 0.04 s (from slo.yaml)" in result.output
    assert "note:" not in result.output


def test_simulate_command_says_when_an_slo_policy_plans_for_another_replica_or_target(tmp_path):
    slo = tmp_path / "slo.yaml"
    slo.write_text("policy: slo\nttft_p99_s: 2\ntpot_p99_s: 0.05\n"
                   "profile: {kv_capacity_tokens: 3000, prefill_tokens_per_s: 1500}\n")
    profile = tmp_path / "profile.yaml"
    profile.write_text("kv_capacity_tokens: 3000\nprefill_tokens_per_s: 3000\n")
    result = CliRunner().invoke(app, ["autoscale", "simulate", "--trace", "ramp:20:1:2", "--policy", str(slo),
                                      "--profile", str(profile), "--slo-tpot", "0.1"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "SLOs TTFT 2 s, TPOT 0.1 s (from slo.yaml and --slo-tpot)" in result.output
    assert "note: slo.yaml targets TTFT 2 s / TPOT 0.05 s but is judged on 2 s / 0.1 s" in result.output
    assert "note: slo.yaml plans with a profile whose prefill_tokens_per_s differ" in result.output
