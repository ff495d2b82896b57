"""The exposition model: the 0.0.4 parser, the two writers, content negotiation and the merge rules."""

from __future__ import annotations

import math
import re
import subprocess

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from serving_image.metrics.exposition import (
    CONTENT_TYPE_OPENMETRICS,
    CONTENT_TYPE_TEXT,
    ExpositionError,
    Family,
    Sample,
    from_client_metrics,
    parse_text,
    write_text,
)
from serving_image.metrics.formats import negotiate
from serving_image.metrics.merge import merge
from serving_image.metrics.openmetrics import write_openmetrics

TRITON = b"""# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="m",version="1"} 161.000000
# HELP nv_inference_queue_summary_us Summary of inference queuing duration in microseconds
# TYPE nv_inference_queue_summary_us summary
nv_inference_queue_summary_us_count{model="m",version="1"} 161
nv_inference_queue_summary_us_sum{model="m",version="1"} 11110
nv_inference_queue_summary_us{model="m",version="1",quantile="0.5"} 55
# HELP nv_gpu_utilization GPU utilization rate [0.0 - 1.0)
# TYPE nv_gpu_utilization gauge
nv_gpu_utilization{gpu_uuid="GPU-1"} 0.5
"""


def test_parses_tritons_exposition_keeping_its_names():
    families = {f.name: f for f in parse_text(TRITON.decode())}
    success = families["nv_inference_request_success"]
    assert success.type == "counter"
    assert success.samples == [Sample("nv_inference_request_success", (("model", "m"), ("version", "1")), 161.0)]
    summary = families["nv_inference_queue_summary_us"]
    assert summary.type == "summary" and len(summary.samples) == 3
    assert write_text(parse_text(TRITON.decode())).count(b"nv_inference_request_success{") == 1
    assert b"nv_inference_request_success_total" not in write_text(parse_text(TRITON.decode()))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<html>", "no metric name"),
        ("a{b=1} 2", "malformed labels"),
        ('a{b="1" 2', "expected ',' or '}'"),
        ("a one", "not a number"),
        ("a 1 2 3", "expected 'value [timestamp]'"),
        ("a 1 1.5", "timestamp"),
        ('a{b="1",b="2"} 1', "label appears twice"),
        ("# TYPE a counter\na 1\nb 1\n# TYPE a gauge\n", "second TYPE"),
        ("# TYPE a counter\na 1\n# TYPE a gauge\n", "TYPE for 'a' after its samples"),
        ("# TYPE a countr\n", "unknown type"),
        ("# TYPE 1a counter\n", "invalid metric name"),
    ],
)
def test_malformed_text_is_rejected_naming_the_line(text, message):
    with pytest.raises(ExpositionError, match=re.escape(message)) as err:
        parse_text("ok 1\n" + text)
    assert f"line {1 + text.count(chr(10)) + (0 if text.endswith(chr(10)) else 1)}:" in str(err.value)


def test_escapes_nan_inf_and_timestamps_round_trip():
    text = '# HELP a Back\\\\slash and \\n newline\n# TYPE a gauge\na{l="q\\"uote\\\\ \\n"} NaN 1700000000000\n' \
           "a{l=\"x\"} +Inf\na{l=\"y\"} -1.5e-3\n"
    (family,) = parse_text(text)
    assert family.help == "Back\\slash and \n newline"
    assert family.samples[0].labels == (("l", 'q"uote\\ \n'),)
    assert math.isnan(family.samples[0].value) and family.samples[0].timestamp_ms == 1700000000000
    assert family.samples[1].value == math.inf
    again = parse_text(write_text([family]).decode())
    assert again[0].samples[1:] == family.samples[1:] and again[0].help == family.help
    om = write_openmetrics([family]).decode()
    assert " NaN 1.7e+09\n" in om or " NaN 1700000000.0\n" in om


def test_prometheus_client_output_converts_to_its_own_0_0_4_text():
    registry = CollectorRegistry()
    counter = Counter("vllm:prompt_tokens", "Prompt tokens.", ["model_name"], registry=registry)
    counter.labels("m").inc(5)
    histogram = Histogram("vllm:ttft_seconds", "TTFT.", ["model_name"], buckets=(0.1, 1), registry=registry)
    histogram.labels("m").observe(0.5)
    ours = parse_text(write_text(from_client_metrics(registry.collect())).decode())
    theirs = parse_text(generate_latest(registry).decode())
    assert [(f.name, f.type, f.help, f.samples) for f in ours] == [
        (f.name, f.type, f.help, f.samples) for f in theirs
    ]  # incl. the *_created gauges that prometheus_client writes beside counters and histograms


names = st.one_of(
    st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True),
    st.sampled_from(["x", "x_total", "y_total", "x_created", "h_count"]),  # names that clash in OpenMetrics
)
label_values = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8)
values = st.one_of(st.floats(allow_nan=False), st.just(math.inf), st.just(-math.inf))


@st.composite
def families(draw):
    out, used = [], set()
    for name in draw(st.lists(names, min_size=1, max_size=4, unique=True)):
        kind = draw(st.sampled_from(["counter", "gauge", "untyped"]))
        label_names = draw(st.lists(names.filter(lambda n: not n.startswith("__")), max_size=3, unique=True))
        samples = []
        for _ in range(draw(st.integers(0, 3))):
            labels = tuple(sorted((k, draw(label_values)) for k in label_names))
            if (name, labels) in used:
                continue
            used.add((name, labels))
            samples.append(Sample(name, labels, draw(values)))
        # Prometheus drops blanks around a HELP text, so the round trip holds for texts without them.
        out.append(Family(name, kind, draw(label_values).strip(" \t\r"), samples))
    return out


@st.composite
def histograms_and_summaries(draw):
    """Histograms and summaries as an upstream may send them: valid, or breaking OpenMetrics' rules."""
    out = []
    for name, kind in (("h", "histogram"), ("q", "summary")):
        samples = []
        for group in draw(st.lists(st.sampled_from(["a", "b"]), max_size=2, unique=True)):
            base = (("g", group),)
            if kind == "histogram":
                les = draw(st.lists(st.sampled_from(["0.5", "1.0", "1", "-1.0", "+Inf"]), max_size=4, unique=True))
                for le in les:
                    labels = tuple(sorted(base + (("le", le),)))
                    samples.append(Sample("h_bucket", labels, draw(st.sampled_from([0.0, 1.0, 2.0, 2.5, -1.0]))))
            else:
                for q in draw(st.lists(st.sampled_from(["0.5", "0.99", "1.5", "0.50"]), max_size=3, unique=True)):
                    labels = tuple(sorted(base + (("quantile", q),)))
                    samples.append(Sample("q", labels, draw(st.sampled_from([0.1, 3.0, -2.0, math.nan]))))
            for suffix in draw(st.lists(st.sampled_from(["_count", "_sum"]), max_size=2, unique=True)):
                samples.append(Sample(name + suffix, base, draw(st.sampled_from([0.0, 2.0, 1.5, -1.0]))))
        out.append(Family(name, kind, "", draw(st.permutations(samples))))
    return out


@settings(max_examples=300, deadline=None)
@given(histograms_and_summaries())
@example([Family("h", "histogram", "", [Sample("h_bucket", (("g", "a"), ("le", "+Inf")), 0.0),
                                         Sample("h_count", (("g", "a"),), 0.0),
                                         Sample("h_sum", (("g", "a"),), -1.0)])])  # found on CI: a negative _sum
def test_openmetrics_output_of_any_histogram_or_summary_parses_with_every_series(fams):
    parsed = list(parse_openmetrics(write_openmetrics(fams).decode()))
    assert sorted((s.name, tuple(sorted(s.labels.items()))) for f in parsed for s in f.samples) == sorted(
        (s.name, s.labels) for f in fams for s in f.samples
    )
    text = write_text(fams)
    assert write_text(parse_text(text.decode())) == text  # (NaN != NaN, so compare the text)


def test_valid_histogram_stays_a_histogram_in_openmetrics():
    (family,) = parse_text(
        '# TYPE h histogram\nh_sum 3\nh_bucket{le="+Inf"} 2\nh_count 2\nh_bucket{le="1.0"} 1\n'
    )
    (parsed,) = parse_openmetrics(write_openmetrics([family]).decode())
    assert parsed.type == "histogram"
    assert [s.name for s in parsed.samples] == ["h_bucket", "h_bucket", "h_count", "h_sum"]


@settings(max_examples=150, deadline=None)
@given(families())
def test_write_then_parse_is_identity(fams):
    assert parse_text(write_text(fams).decode()) == fams


@settings(max_examples=100, deadline=None)
@given(families())
def test_openmetrics_output_parses_with_the_reference_parser(fams):
    parsed = list(parse_openmetrics(write_openmetrics(fams).decode()))  # raises on anything not OpenMetrics
    typed = {f.name: f.type for f in parsed}
    for family in fams:
        if family.type == "gauge":
            assert typed[family.name] == "gauge"
    # every series comes through, typed or not
    assert sorted((s.name, tuple(sorted(s.labels.items()))) for f in parsed for s in f.samples) == sorted(
        (s.name, s.labels) for f in fams for s in f.samples
    )


def test_promtool_parses_both_writers_output(tmp_path):
    fams = parse_text(TRITON.decode())
    result = subprocess.run(["promtool", "check", "metrics"], input=write_text(fams), capture_output=True)
    assert result.returncode in (0, 3), result.stderr


@pytest.mark.parametrize(
    ("accept", "fmt", "content_type"),
    [
        (None, "text", CONTENT_TYPE_TEXT),
        ("", "text", CONTENT_TYPE_TEXT),
        ("text/plain;version=0.0.4", "text", CONTENT_TYPE_TEXT),
        ("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1", "openmetrics",
         CONTENT_TYPE_OPENMETRICS),
        ("application/openmetrics-text; version=0.0.1", "openmetrics", CONTENT_TYPE_OPENMETRICS),
        ("application/openmetrics-text;version=2.0.0", "text", CONTENT_TYPE_TEXT),
        ("text/plain;q=1,application/openmetrics-text;q=0.5", "text", CONTENT_TYPE_TEXT),
        ("application/json", "text", CONTENT_TYPE_TEXT),
    ],
)
def test_negotiation(accept, fmt, content_type):
    assert negotiate(accept) == (fmt, content_type)


def test_openmetrics_maps_counters_and_keeps_tritons_names():
    fams = [
        Family("vllm:requests_total", "counter", "r", [Sample("vllm:requests_total", (), 3)]),
        Family("nv_inference_count", "counter", "n", [Sample("nv_inference_count", (), 4)]),
        Family("loose", "untyped", "", [Sample("loose", (), 1)]),
    ]
    text = write_openmetrics(fams).decode()
    assert "# TYPE vllm:requests counter\nvllm:requests_total 3.0\n" in text
    assert "# TYPE nv_inference_count unknown\nnv_inference_count 4.0\n" in text
    assert "# TYPE loose unknown\n" in text and text.endswith("# EOF\n")


def test_merge_priority_shadowing_and_duplicates():
    vllm = [Family("vllm:x_total", "counter", "", [Sample("vllm:x_total", (("engine", "0"),), 1)])]
    upstream = [
        Family("vllm:x_total", "counter", "", [Sample("vllm:x_total", (("model", "m"),), 9)]),
        Family("a", "untyped", "", [Sample("a", (), 1)]),
        Family("a", "untyped", "", [Sample("a", (), 2)]),  # 0.0.4 allows repeating a name without TYPE
        Family("h", "histogram", "", [Sample("h_bucket", (("le", "+Inf"),), 1)]),
        Family("h_bucket", "gauge", "", [Sample("h_bucket", (), 1)]),  # collides with a sample name of h
    ]
    report = merge([("vllm", vllm), ("upstream", upstream)])
    assert [f.name for f in report.families] == ["vllm:x_total", "a", "h"]
    assert report.families[0].samples == vllm[0].samples
    assert report.families[1].samples == [Sample("a", (), 1)]
    assert report.duplicate_series == 1
    assert report.shadowed == [("upstream", "vllm:x_total"), ("upstream", "h_bucket")]


def test_openmetrics_never_gives_two_families_one_name():
    """0.0.4 can hold gauge `x` beside counter `x_total`; OpenMetrics would call both `x`, so the counter stays
    `unknown` under its 0.0.4 name."""
    fams = [
        Family("x", "gauge", "", [Sample("x", (), 1)]),
        Family("x_total", "counter", "", [Sample("x_total", (), 2)]),
    ]
    parsed = {f.name: f.type for f in parse_openmetrics(write_openmetrics(fams).decode())}
    assert parsed == {"x": "gauge", "x_total": "unknown"}


def test_openmetrics_counter_whose_created_name_is_taken_stays_unknown():
    fams = [
        Family("x_total", "counter", "", [Sample("x_total", (), 1)]),
        Family("x_created", "gauge", "", [Sample("x_created", (), 2)]),
        Family("y_total", "counter", "", [Sample("y_total", (), -1)]),  # OpenMetrics counters cannot go negative
    ]
    parsed = {f.name: f.type for f in parse_openmetrics(write_openmetrics(fams).decode())}
    assert parsed == {"x_total": "unknown", "x_created": "gauge", "y_total": "unknown"}
