"""A remote server's /metrics read into the throughput panel's numbers: exposition text in vLLM's
and SGLang's published formats (fixtures/, source named in each), kimitui serve's own, rates
between scrapes; the <think> splitter and error lines of the chat stream; base-URL forms."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimitui.client.chat_stream import error_line
from kimitui.client.http import server_root
from kimitui.client.server_metrics import Histogram, parse_server_metrics
from kimitui.client.server_stats import ServerStatsTracker
from kimitui.client.think_split import ThinkSplitter
from kimitui.engine.spec_decode.stats import SpecDecodeStats
from kimitui.server.metrics import ServerMetrics
from tests.kimitui.tui_fakes import stats

FIXTURES = Path(__file__).parents[1] / "fixtures"


def test_vllm_v1_exposition():
    snap = parse_server_metrics((FIXTURES / "metrics_vllm.txt").read_text())
    assert snap.flavour == "vllm"
    assert (snap.prompt_tokens, snap.generation_tokens) == (5000, 2000)  # summed over both engines
    assert (snap.running, snap.waiting) == (5, 1)
    assert snap.kv_usage == pytest.approx(0.375)  # a fraction: averaged, not summed
    assert snap.kv_capacity_tokens == 1000 * 16  # num_gpu_blocks x block_size labels
    assert snap.cumulative_prefix_hit_rate == pytest.approx(1000 / 4000)
    # TTFT: 10 requests, 2 <= 20 ms, 6 <= 40 ms: the median (rank 5) is 3/4 into the 20-40 ms bucket
    assert snap.ttft.quantile(0.5) == pytest.approx(0.035)
    assert snap.ttft.mean == pytest.approx(0.09)
    assert snap.tpot.count == 10 and snap.tpot.quantile(0.9) == pytest.approx(0.0235)
    assert snap.spec_decode is None


def test_sglang_exposition():
    snap = parse_server_metrics((FIXTURES / "metrics_sglang.txt").read_text())
    assert snap.flavour == "sglang"
    assert (snap.prompt_tokens, snap.generation_tokens) == (8.0e6, 7.5e6)
    assert (snap.running, snap.waiting, snap.kv_usage) == (12, 4, 0.28)
    assert snap.cumulative_prefix_hit_rate == pytest.approx(0.0075)
    assert snap.kv_capacity_tokens is None  # not in this version's exposition: shown as n/a
    assert snap.ttft.count == 20 and snap.ttft.quantile(0.5) == pytest.approx(0.5 + 0.5 * 2 / 12)
    assert snap.tpot.quantile(0.5) == pytest.approx(0.01)


def test_kimitui_serve_exposition_with_spec_decode():
    spec = SpecDecodeStats(num_drafts=10, num_draft_tokens=30, num_accepted_tokens=15, accepted_per_pos=[8, 5, 2])
    metrics = ServerMetrics("kimitui-demo")
    text = metrics.render(stats(decode=12.0, generated=345, spec_decode=spec))
    snap = parse_server_metrics(text)
    assert snap.flavour == "kimitui"
    assert (snap.prompt_tokens, snap.generation_tokens, snap.kv_capacity_tokens) == (100, 345, 4096)
    assert (snap.running, snap.waiting, snap.kv_usage, snap.prefix_hit_rate) == (1, 0, 0.25, 0.5)
    assert snap.ttft.count == 0 and snap.ttft.quantile(0.5) is None
    assert snap.spec_decode.num_accepted_tokens == 15 and snap.spec_decode.accepted_per_pos == [8, 5, 2]


def test_unknown_and_broken_text():
    assert parse_server_metrics("# TYPE up gauge\nup 1\n").flavour is None
    with pytest.raises(ValueError, match="not Prometheus text"):
        parse_server_metrics("<html>oops</html>")


def vllm_text(prompt: float, generated: float, ttft_counts=(0, 0), ttft_sum=0.0) -> str:
    return (
        f"vllm:prompt_tokens_total {prompt}\nvllm:generation_tokens_total {generated}\n"
        f"vllm:num_requests_running 1\n"
        f'vllm:time_to_first_token_seconds_bucket{{le="0.1"}} {ttft_counts[0]}\n'
        f'vllm:time_to_first_token_seconds_bucket{{le="+Inf"}} {ttft_counts[1]}\n'
        f"vllm:time_to_first_token_seconds_sum {ttft_sum}\n"
        f"vllm:time_to_first_token_seconds_count {ttft_counts[1]}\n"
    )


def test_rates_come_from_counter_differences_and_a_restart_starts_over():
    tracker = ServerStatsTracker()
    first = tracker.add(100.0, parse_server_metrics(vllm_text(1000, 500, (4, 4), 0.2)))
    assert first.decode_tokens_per_s is None and first.num_running == 1  # one scrape: no rate yet
    s = tracker.add(101.0, parse_server_metrics(vllm_text(1400, 600, (4, 6), 0.5)))
    assert s.decode_tokens_per_s == pytest.approx(100.0) and s.prefill_tokens_per_s == pytest.approx(400.0)
    s = tracker.add(105.0, parse_server_metrics(vllm_text(1400, 900, (4, 6), 0.5)))
    assert s.decode_tokens_per_s == pytest.approx(300 / 4)  # over the last RATE_WINDOW_S, from t=101
    # TTFT over the window counts the two requests seen since the first scrape, both above 100 ms
    assert s.ttft_p50 == pytest.approx(0.1)
    assert "vllm /metrics" in s.note and "KV use" in s.note
    s = tracker.add(106.0, parse_server_metrics(vllm_text(10, 5)))  # counters went back: restarted
    assert s.decode_tokens_per_s is None and s.total_generation_tokens == 5


def test_histogram_since_and_inf_bucket():
    before = Histogram((0.1, float("inf")), (1, 1), 0.05, 1)
    now = Histogram((0.1, float("inf")), (1, 3), 5.05, 3)
    window = now.since(before)
    assert window.counts == (0, 2) and window.mean == pytest.approx(2.5)
    assert window.quantile(0.5) == 0.1  # a rank in +Inf answers the largest finite bound
    assert now.since(Histogram((0.1, float("inf")), (9, 9), 1, 9)) is now  # restarted: all of it


@pytest.mark.parametrize(
    "text, reasoning, content",
    [
        ("<think>plan it</think>The answer.", "plan it", "The answer."),
        ("no tags at all", "", "no tags at all"),
        ("opened by the prompt</think>answer", "opened by the prompt", "answer"),
        ("a < b and <thin ice>", "", "a < b and <thin ice>"),
        ("<think>unfinished", "unfinished", ""),
    ],
)
def test_think_splitter_any_chunking(text, reasoning, content):
    for cut in range(len(text) + 1):
        for step in (1, 3):
            s = ThinkSplitter()
            s.feed(text[:cut])
            rest = text[cut:]
            for i in range(0, len(rest), step):
                s.feed(rest[i : i + step])
            s.finish()
            assert (s.reasoning, s.content) == (reasoning, content), (cut, step)


def test_error_lines():
    body = b'{"error": {"message": "max_tokens is too large:\\n 9999 > 512", "type": "BadRequestError"}}'
    assert error_line(400, "Bad Request", body) == "HTTP 400 Bad Request: max_tokens is too large: 9999 > 512"
    assert (
        error_line(404, "Not Found", b'{"object": "error", "message": "The model `x` does not exist."}')
        == "HTTP 404 Not Found: The model `x` does not exist."
    )
    assert (
        error_line(502, "Bad Gateway", b"<html>\n<body>proxy down</body>\n</html>")
        == "HTTP 502 Bad Gateway: <html> <body>proxy down</body> </html>"
    )
    assert error_line(500, "Internal Server Error", b"") == "HTTP 500 Internal Server Error"


@pytest.mark.parametrize(
    "url", ["http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/", " http://h:8000/v1 "]
)
def test_base_url_with_or_without_v1(url):
    assert server_root(url) == "http://h:8000"
