"""/metrics as people coming from vLLM read it: per-request series labelled model_name, the KV
usage ratio, running and waiting; no pid label; kv_pages states that add up; recovery buckets
that tell 5 ms from 50 ms; a build-info series."""
import re

from prometheus_client.parser import text_string_to_metric_families

from kvhold.serving.metrics import SidecarMetrics


def status() -> dict:
    return {"executors": [{"slot": 0, "role": "active", "pid": 41, "heartbeat_age_ms": 2.0},
                          {"slot": 1, "role": "standby", "pid": 42, "heartbeat_age_ms": 3.0}],
            "pages": {"total": 101, "free": 76, "committed": 25, "writing": 0, "quarantined": 0, "bad": 0},
            "requests": {"in_flight": 5, "admitted_total": 9, "finished": {"length": 4}, "waiting": 2},
            "weights": {"state": "sealed"}, "generation": 1, "recoveries": [], "events": []}


def samples(m) -> dict:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_request_series_after_two_requests():
    m = SidecarMetrics("tiny-v1")
    m.observe(status())
    m.observe_request(received=10.0, first_token=10.2, token_times=[10.2, 10.25, 10.35], end=10.35,
                      prompt_tokens=7, generation_tokens=3, preemptions=1, finish_reason="length")
    m.observe_request(received=11.0, first_token=None, token_times=[], end=11.5, prompt_tokens=4,
                      generation_tokens=0, preemptions=0, finish_reason=None)
    s = samples(m)
    name = (("model_name", "tiny-v1"),)
    assert s[("kvhold_prompt_tokens_total", name)] == 11
    assert s[("kvhold_generation_tokens_total", name)] == 3
    assert s[("kvhold_num_preemptions_total", name)] == 1
    assert s[("kvhold_time_to_first_token_seconds_count", name)] == 1
    assert s[("kvhold_time_per_output_token_seconds_count", name)] == 2           # two gaps
    assert s[("kvhold_e2e_request_latency_seconds_count", name)] == 2
    assert abs(s[("kvhold_request_decode_time_seconds_sum", name)] - 0.15) < 1e-9
    assert s[("kvhold_request_success_total", (("finished_reason", "length"),) + name)] == 1
    assert s[("kvhold_request_success_total", (("finished_reason", "abort"),) + name)] == 1
    assert s[("kvhold_num_requests_running", name)] == 3
    assert s[("kvhold_num_requests_waiting", name)] == 2
    assert s[("kvhold_kv_cache_usage_ratio", name)] == 0.25
    assert s[("kvhold_build_info", (("version", __import__("kvhold").__version__),))] == 1


def test_no_pid_label_and_page_states_that_add_up():
    m = SidecarMetrics("tiny-v1")
    m.observe(status())
    text = m.render().decode()
    assert "pid=" not in text
    s = samples(m)
    states = {dict(labels)["state"]: v for (n, labels), v in s.items() if n == "kvhold_kv_pages"}
    assert "total" not in states and sum(states.values()) == s[("kvhold_kv_pool_pages", ())] == 101


def test_prefix_cache_counters_and_idle_cached_pages_counted_as_free():
    m = SidecarMetrics("tiny-v1")
    st = status()
    st["pages"] = {"total": 101, "free": 56, "committed": 25, "cached": 20, "writing": 0, "quarantined": 0,
                   "bad": 0}
    st["prefix_cache"] = {"queries": 900, "hits": 600, "hit_rate": 2 / 3}
    m.observe(st)
    s = samples(m)
    name = (("model_name", "tiny-v1"),)
    assert s[("kvhold_prefix_cache_queries_total", name)] == 900
    assert s[("kvhold_prefix_cache_hits_total", name)] == 600
    assert s[("kvhold_kv_cache_usage_ratio", name)] == 0.25              # the 20 idle cached pages: free
    assert s[("kvhold_kv_pages", (("state", "cached"),))] == 20
    m.observe(status())                                                  # no cache: no series
    assert not any(n.startswith("kvhold_prefix_cache") for n, _ in samples(m))


def test_every_series_exists_from_start_up_with_vllms_bucket_edges():
    from kvhold.serving.metrics import (VLLM_REQUEST_LATENCY_BUCKETS, VLLM_TOKEN_GAP_BUCKETS,
                                        VLLM_TTFT_BUCKETS)

    m = SidecarMetrics("tiny-v1")
    text = m.render().decode()
    name = 'model_name="tiny-v1"'
    for series in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
                   "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                   "request_inference_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                   "request_params_max_tokens", "request_params_n", "request_max_num_generation_tokens"):
        assert f"kvhold_{series}_count{{{name}}} 0.0" in text, series
    assert 'kvhold_http_time_to_first_token_seconds_count{endpoint="/v1/completions"} 0.0' in text
    for series, edges in (("time_to_first_token_seconds", VLLM_TTFT_BUCKETS),
                          ("time_per_output_token_seconds", VLLM_TOKEN_GAP_BUCKETS),
                          ("e2e_request_latency_seconds", VLLM_REQUEST_LATENCY_BUCKETS)):
        for le in edges:
            assert f'kvhold_{series}_bucket{{le="{float(le)}",{name}}} 0.0' in text, (series, le)


def test_inference_time_max_tokens_n_and_the_cache_config():
    m = SidecarMetrics("tiny-v1")
    st = status()
    st["serving"] = {"page_tokens": 16, "kv_dtype": "bfloat16", "prefix_caching": True}
    m.observe(st)
    m.observe_request(received=10.0, first_token=10.2, token_times=[10.2, 10.5], end=10.5, prompt_tokens=7,
                      generation_tokens=2, preemptions=0, finish_reason="length", queue_s=0.05, prefill_s=0.12,
                      max_tokens=64)
    m.observe_choices(3)
    s = samples(m)
    name = (("model_name", "tiny-v1"),)
    assert abs(s[("kvhold_request_inference_time_seconds_sum", name)] - 0.42) < 1e-9      # 0.12 + 0.3
    assert s[("kvhold_request_params_max_tokens_sum", name)] == 64
    assert s[("kvhold_request_params_n_sum", name)] == 3
    info = {(n, labels): v for (n, labels), v in s.items() if n == "kvhold_cache_config_info"}
    assert list(info.values()) == [1.0]
    assert dict(next(iter(info))[1]) == {"block_size": "16", "num_gpu_blocks": "100", "cache_dtype": "bfloat16",
                                         "enable_prefix_caching": "True"}


def test_recovery_buckets_tell_5_from_50_ms():
    m = SidecarMetrics()
    m.recovery.observe(0.005)
    m.recovery.observe(0.0508)
    buckets = {float(b): v for b, v in re.findall(r'kvhold_recovery_seconds_bucket\{le="([^"]+)"\} (\S+)',
                                                  m.render().decode()) if b != "+Inf"}
    first = min(b for b, v in buckets.items() if float(v) >= 1)
    second = min(b for b, v in buckets.items() if float(v) >= 2)
    assert first <= 0.005 and second <= 0.06 and second > first


def test_queue_and_prefill_times_as_vllm_names_them():
    m = SidecarMetrics("tiny-v1")
    m.observe_request(received=10.0, first_token=10.2, token_times=[10.2], end=10.3, prompt_tokens=7,
                      generation_tokens=1, preemptions=0, finish_reason="length", queue_s=0.05, prefill_s=0.12)
    m.observe_request(received=11.0, first_token=None, token_times=[], end=11.5, prompt_tokens=4,
                      generation_tokens=0, preemptions=0, finish_reason=None)     # not known: not observed
    s = samples(m)
    name = (("model_name", "tiny-v1"),)
    assert s[("kvhold_request_queue_time_seconds_count", name)] == 1
    assert abs(s[("kvhold_request_queue_time_seconds_sum", name)] - 0.05) < 1e-9
    assert s[("kvhold_request_prefill_time_seconds_count", name)] == 1
    assert abs(s[("kvhold_request_prefill_time_seconds_sum", name)] - 0.12) < 1e-9
    assert s[("kvhold_request_queue_time_seconds_bucket", (("le", "0.04"),) + name)] == 0
    assert s[("kvhold_request_queue_time_seconds_bucket", (("le", "0.06"),) + name)] == 1
