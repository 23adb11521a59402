import pytest

from kvproxy.fleet.engine_metrics import EngineMetrics, parse_engine_metrics

# Excerpt of a constructed SGLang 0.5.23 /metrics text (labels sorted, as in
# prometheus_client multiprocess mode).
SAMPLE = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 24.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 3.0
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 1843.7
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.42
# HELP sglang:full_token_usage The token usage for full attention layers.
# TYPE sglang:full_token_usage gauge
sglang:full_token_usage{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.4219
# HELP sglang:num_used_tokens The number of used tokens.
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 191552.0
# HELP sglang:kv_available_tokens Number of free token slots in the KV cache pool.
# TYPE sglang:kv_available_tokens gauge
sglang:kv_available_tokens{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 121088.0
# HELP sglang:kv_evictable_tokens Number of evictable (radix-cached) token slots in the KV cache pool.
# TYPE sglang:kv_evictable_tokens gauge
sglang:kv_evictable_tokens{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 141360.0
# HELP sglang:kv_used_tokens Number of actively used token slots in the KV cache pool.
# TYPE sglang:kv_used_tokens gauge
sglang:kv_used_tokens{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 191552.0
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 454000.0
# HELP sglang:page_size KV cache page size in tokens.
# TYPE sglang:page_size gauge
sglang:page_size{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 1.0
# HELP sglang:num_streaming_sessions The number of streaming sessions.
# TYPE sglang:num_streaming_sessions gauge
sglang:num_streaming_sessions{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 17.0
# HELP sglang:streaming_session_held_tokens The number of KV tokens currently held by streaming session slots.
# TYPE sglang:streaming_session_held_tokens gauge
sglang:streaming_session_held_tokens{engine_type="unified",model_name="Qwen/Qwen3-8B",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 52000.0
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{engine_type="unified",is_streaming="false",model_name="Qwen/Qwen3-8B"} 1.2843211e+07
sglang:prompt_tokens_total{engine_type="unified",is_streaming="true",model_name="Qwen/Qwen3-8B"} 4.22101e+06
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{engine_type="unified",le="0.1",model_name="Qwen/Qwen3-8B"} 4102.0
sglang:time_to_first_token_seconds_bucket{engine_type="unified",le="+Inf",model_name="Qwen/Qwen3-8B"} 5231.0
sglang:time_to_first_token_seconds_count{engine_type="unified",model_name="Qwen/Qwen3-8B"} 5231.0
sglang:time_to_first_token_seconds_sum{engine_type="unified",model_name="Qwen/Qwen3-8B"} 612.4
"""

SAMPLE_EXPECTED = EngineMetrics(
    max_total_num_tokens=454000,
    token_usage=0.42,
    num_used_tokens=191552,
    kv_evictable_tokens=141360,
    num_running_reqs=24,
    num_queue_reqs=3,
    num_streaming_sessions=17,
    streaming_session_held_tokens=52000,
    usage_source="token_usage",
)


def test_sample_0_5_23() -> None:
    assert parse_engine_metrics(SAMPLE) == SAMPLE_EXPECTED


def test_router_underscore_prefix() -> None:
    text = SAMPLE.replace("sglang:", "sglang_")
    assert parse_engine_metrics(text) == SAMPLE_EXPECTED


def _g(name: str, labels: str, value: str) -> str:
    return f"sglang:{name}{{{labels}}} {value}"


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        pytest.param([], EngineMetrics(), id="empty"),
        pytest.param(
            # The very first line has no preceding newline.
            ["sglang:token_usage 0.5", "sglang:max_total_num_tokens 1000"],
            EngineMetrics(max_total_num_tokens=1000, token_usage=0.5, usage_source="token_usage"),
            id="no-labels-first-line",
        ),
        pytest.param(
            [
                _g("token_usage", 'tp_rank="0",model_name="m"', "0.92"),
                _g("token_usage", 'model_name="m",tp_rank="1"', "0.92"),
                _g("max_total_num_tokens", 'tp_rank="0"', "1000"),
                _g("max_total_num_tokens", 'tp_rank="1"', "1000"),
                _g("num_used_tokens", 'tp_rank="0"', "920"),
                _g("num_used_tokens", 'tp_rank="1"', "920"),
            ],
            EngineMetrics(
                max_total_num_tokens=1000,
                token_usage=0.92,
                num_used_tokens=920,
                usage_source="token_usage",
            ),
            id="tp-replicated-max-not-sum",
        ),
        pytest.param(
            [
                _g("token_usage", 'tp_rank="0"', "0.30"),
                _g("token_usage", 'tp_rank="1"', "0.70"),
                _g("num_running_reqs", 'tp_rank="0",pp_rank="0"', "3"),
                _g("num_running_reqs", 'pp_rank="1",tp_rank="0"', "5"),
            ],
            EngineMetrics(token_usage=0.7, num_running_reqs=5, usage_source="token_usage"),
            id="differing-replicas-take-max",
        ),
        pytest.param(
            [
                _g("token_usage", 'dp_rank="0",tp_rank="0"', "0.20"),
                _g("token_usage", 'dp_rank="1",tp_rank="0"', "0.80"),
                _g("token_usage", 'dp_rank="1",tp_rank="1"', "0.80"),
                _g("max_total_num_tokens", 'dp_rank="0",tp_rank="0"', "1000"),
                _g("max_total_num_tokens", 'dp_rank="0",tp_rank="1"', "1000"),
                _g("max_total_num_tokens", 'dp_rank="1",tp_rank="0"', "1000"),
                _g("num_used_tokens", 'dp_rank="0"', "200"),
                _g("num_used_tokens", 'dp_rank="1"', "800"),
                _g("num_queue_reqs", 'dp_rank="0"', "1"),
                _g("num_queue_reqs", 'dp_rank="1"', "2"),
                _g("kv_evictable_tokens", 'dp_rank="0"', "10"),
                _g("kv_evictable_tokens", 'dp_rank="1"', "30"),
            ],
            EngineMetrics(
                max_total_num_tokens=2000,
                token_usage=0.8,
                num_used_tokens=1000,
                kv_evictable_tokens=40,
                num_queue_reqs=3,
                usage_source="token_usage",
            ),
            id="dp-ranks-sum-tokens-max-usage",
        ),
        pytest.param(
            [
                _g("max_total_num_tokens", 'attn_dp_rank="0"', "1000"),
                _g("max_total_num_tokens", 'attn_dp_rank="1"', "1000"),
                _g("token_usage", 'attn_dp_rank="1"', "0.1"),
            ],
            EngineMetrics(max_total_num_tokens=1000, token_usage=0.1, usage_source="token_usage"),
            id="attn-dp-rank-is-not-dp-rank",
        ),
        pytest.param(
            [
                _g("full_token_usage", 'tp_rank="0"', "0.33"),
                _g("max_total_num_tokens", 'tp_rank="0"', "1000"),
                _g("num_used_tokens", 'tp_rank="0"', "900"),
            ],
            EngineMetrics(
                max_total_num_tokens=1000,
                token_usage=0.33,
                num_used_tokens=900,
                usage_source="full_token_usage",
            ),
            id="fallback-full-token-usage",
        ),
        pytest.param(
            [
                _g("max_total_num_tokens", 'dp_rank="0"', "1000"),
                _g("max_total_num_tokens", 'dp_rank="1"', "1000"),
                _g("num_used_tokens", 'dp_rank="0"', "250"),
                _g("num_used_tokens", 'dp_rank="1"', "600"),
            ],
            EngineMetrics(
                max_total_num_tokens=2000,
                token_usage=0.6,
                num_used_tokens=850,
                usage_source="derived",
            ),
            id="derived-per-dp-then-max",
        ),
        pytest.param(
            [
                _g("token_usage", "", "0.0"),
                _g("max_total_num_tokens", "", "1000"),
                _g("num_used_tokens", "", "4"),
            ],
            EngineMetrics(
                max_total_num_tokens=1000,
                token_usage=0.004,
                num_used_tokens=4,
                usage_source="derived",
            ),
            id="rounded-zero-usage-replaced-by-derived",
        ),
        pytest.param(
            [
                "# HELP sglang:token_usage The token usage.",
                "# TYPE sglang:token_usage gauge",
                "garbage line {{{ without structure",
                'sglang:token_usage{tp_rank="0"}',  # no value
                'sglang:token_usage{tp_rank="0"} not-a-number',
                'sglang:token_usage{tp_rank="0"} NaN',
                'sglang:token_usage{tp_rank="0"} -1',
                'sglang:token_usage_extra{tp_rank="0"} 0.99',
                "sglang:num_used_tokens_total 77",
                "xsglang:token_usage 0.98",
                'sglang:token_usage{tp_rank="0"} 0.25 1700000000000',
                'sglang:max_total_num_tokens{model_name="a}b",tp_rank="0"} 500\r',
            ],
            EngineMetrics(max_total_num_tokens=500, token_usage=0.25, usage_source="token_usage"),
            id="comments-garbage-longer-names-timestamps-crlf",
        ),
        pytest.param(
            [
                _g("max_total_num_tokens", 'tp_rank="0"', "1000"),
                _g("hicache_host_total_tokens", 'tp_rank="0"', "2000"),
                _g("hicache_host_total_tokens", 'tp_rank="1"', "2000"),
                _g("hicache_host_used_tokens", 'tp_rank="0"', "700"),
            ],
            EngineMetrics(max_total_num_tokens=1000, hicache_host_total_tokens=2000),
            id="hicache-host-tier-once-per-engine",
        ),
        pytest.param(
            [_g("token_usage", "", "1.7")],
            EngineMetrics(token_usage=1.0, usage_source="token_usage"),
            id="usage-clamped",
        ),
    ],
)
def test_parse_table(lines: list[str], expected: EngineMetrics) -> None:
    assert parse_engine_metrics("\n".join(lines) + "\n") == expected


def test_no_trailing_newline_and_tabs() -> None:
    text = "sglang:num_queue_reqs\t7"
    assert parse_engine_metrics(text).num_queue_reqs == 7
