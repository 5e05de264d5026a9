"""Monitoring assets: the Prometheus alert rules, their promtool unit tests, the Grafana dashboard."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest
import yaml

MONITORING: Final = Path(__file__).resolve().parent.parent / "ops" / "monitoring"
ALERTS_FILE: Final = MONITORING / "edgellm-alerts.yml"
ALERTS_TEST_FILE: Final = MONITORING / "edgellm-alerts.test.yml"
DASHBOARD_FILE: Final = MONITORING / "edgellm-dashboard.json"
README_FILE: Final = MONITORING / "README.md"

PROMTOOL_TIMEOUT_S: Final = 120

# The daemon's /metrics contract: metric name -> its label names. Coupled to the daemon's
# exporter: a metric renamed or relabelled there must change here, in the rules and in the
# dashboard (which is what these tests are for).
CONTRACT: Final[dict[str, frozenset[str]]] = {
    name: frozenset(labels.split())
    for name, labels in {
        "edgellm_build_info": "version",
        "edgellm_requests_total": "endpoint status key_id",
        "edgellm_request_duration_seconds": "endpoint",
        "edgellm_time_to_first_token_seconds": "model model_name",
        "edgellm_time_to_first_token_from_admission_seconds": "model",
        "edgellm_inter_token_latency_seconds": "model model_name",
        "edgellm_request_queue_time_seconds": "model model_name api",
        "edgellm_request_prefill_time_seconds": "model model_name api",
        "edgellm_request_decode_time_seconds": "model model_name api",
        "edgellm_e2e_request_latency_seconds": "model model_name api",
        "edgellm_request_prompt_tokens": "model model_name api",
        "edgellm_request_generation_tokens": "model model_name api",
        "edgellm_request_success_total": "model model_name api finished_reason",
        "edgellm_request_slo_total": "model model_name api result",
        "edgellm_num_requests_running": "model model_name",
        "edgellm_num_requests_waiting": "model model_name",
        "edgellm_trace_exports_total": "result",
        "edgellm_prompt_tokens_total": "model model_name",
        "edgellm_completion_tokens_total": "model model_name",
        "edgellm_slots_busy": "model",
        "edgellm_slots_total": "model",
        "edgellm_queue_depth": "model",
        "edgellm_queue_size": "model",
        "edgellm_model_info": "model version sha256",
        "edgellm_model_state": "model state",
        "edgellm_reloads_total": "model result",
        "edgellm_rate_limited_total": "reason",
        "edgellm_queue_rejections_total": "model",
        "edgellm_fair_admissions_total": "model",
        "edgellm_draft_tokens_total": "model",
        "edgellm_draft_accepted_tokens_total": "model",
        "edgellm_prompt_cache_hits_total": "model",
        "edgellm_prompt_cache_misses_total": "model",
        "edgellm_prompt_cache_restored_tokens_total": "model",
        "edgellm_prompt_cache_restore_seconds_total": "model",
        "edgellm_prompt_cache_evictions_total": "model",
        "edgellm_prompt_cache_bytes": "model",
        "edgellm_gpu_up": "gpu name",
        "edgellm_gpu_memory_used_bytes": "gpu",
        "edgellm_gpu_memory_total_bytes": "gpu",
        "edgellm_gpu_utilization_ratio": "gpu",
        "edgellm_gpu_temperature_celsius": "gpu",
        "edgellm_gpu_power_watts": "gpu",
        "edgellm_gpu_power_limit_watts": "gpu",
        "edgellm_gpu_throttle_active": "gpu reason",
        "edgellm_gpu_ecc_volatile_errors": "gpu kind",
        "edgellm_host_cpu_usage_ratio": "",
        "edgellm_host_memory_used_bytes": "",
        "edgellm_host_memory_total_bytes": "",
        "edgellm_host_load1": "",
        "edgellm_process_resident_memory_bytes": "",
        "edgellm_engine_resident_memory_bytes": "model",
        "edgellm_process_threads": "",
        "edgellm_process_open_fds": "",
        "edgellm_shm_used_bytes": "",
        "edgellm_shm_free_bytes": "",
    }.items()
}
HISTOGRAMS: Final = frozenset(
    {
        "edgellm_request_duration_seconds",
        "edgellm_time_to_first_token_seconds",
        "edgellm_time_to_first_token_from_admission_seconds",
        "edgellm_inter_token_latency_seconds",
        "edgellm_request_queue_time_seconds",
        "edgellm_request_prefill_time_seconds",
        "edgellm_request_decode_time_seconds",
        "edgellm_e2e_request_latency_seconds",
        "edgellm_request_prompt_tokens",
        "edgellm_request_generation_tokens",
    }
)
TARGET_LABELS: Final = frozenset({"job", "instance"})  # added by Prometheus at scrape time


def _series_labels() -> dict[str, frozenset[str]]:
    """Every series name a query may select (histograms expose _bucket/_sum/_count only)."""
    series: dict[str, frozenset[str]] = {}
    for name, labels in CONTRACT.items():
        if name in HISTOGRAMS:
            series[f"{name}_bucket"] = labels | TARGET_LABELS | {"le"}
            series[f"{name}_sum"] = labels | TARGET_LABELS
            series[f"{name}_count"] = labels | TARGET_LABELS
        else:
            series[name] = labels | TARGET_LABELS
    return series


SERIES: Final = _series_labels()

METRIC_RE: Final = re.compile(r"edgellm_[a-z0-9_]+")
SELECTOR_RE: Final = re.compile(r"(edgellm_[a-z0-9_]+)\s*\{([^}]*)\}")
MATCHER_RE: Final = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")

ALERTS: Final = frozenset(
    {
        "EdgellmDown",
        "EdgellmModelNotServing",
        "EdgellmReloadFailures",
        "EdgellmQueueSaturated",
        "EdgellmServerOverloaded",
        "EdgellmRateLimitStorm",
        "EdgellmSlowFirstToken",
        "EdgellmGpuThermalThrottling",
        "EdgellmGpuPowerCapped",
        "EdgellmGpuEccErrors",
        "EdgellmGpuLost",
        "EdgellmHighMemory",
        "EdgellmShmFull",
    }
)
# What each alert's description must name, so that whoever is paged knows where to look.
SUBJECT_LABELS: Final[dict[str, tuple[str, ...]]] = {
    "EdgellmDown": ("instance",),
    "EdgellmModelNotServing": ("instance", "model"),
    "EdgellmReloadFailures": ("instance", "model"),
    "EdgellmQueueSaturated": ("instance", "model"),
    "EdgellmServerOverloaded": ("instance", "model"),
    "EdgellmRateLimitStorm": ("instance", "reason"),
    "EdgellmSlowFirstToken": ("instance", "model"),
    "EdgellmGpuThermalThrottling": ("instance", "gpu", "reason"),
    "EdgellmGpuPowerCapped": ("instance", "gpu"),
    "EdgellmGpuEccErrors": ("instance", "gpu"),
    "EdgellmGpuLost": ("instance", "gpu", "name"),
    "EdgellmHighMemory": ("instance",),
    "EdgellmShmFull": ("instance",),
}
SEVERITIES: Final = frozenset({"warning", "critical"})
DATASOURCE_REF: Final = {"type": "prometheus", "uid": "${datasource}"}
ROWS: Final = ["Traffic", "Serving", "Models", "Limits", "GPU", "Host"]
# Grafana variables in dashboard queries, replaced by values promtool can parse.
GRAFANA_VARIABLES: Final = {"$__rate_interval": "5m", "$instance": ".*", "$model": ".*"}


def unknown_metrics(expr: str) -> set[str]:
    """The edgellm_* names in a query that the daemon does not export."""
    return {name for name in METRIC_RE.findall(expr) if name not in SERIES}


def unknown_labels(expr: str) -> set[str]:
    """`metric{label}` for each label matcher in a selector that the metric does not carry."""
    found: set[str] = set()
    for metric, matchers in SELECTOR_RE.findall(expr):
        known = SERIES.get(metric)
        if known is None:
            continue  # reported by unknown_metrics
        # Drop quoted values first: a regex value may itself contain `=`.
        bare = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', matchers)
        found |= {f"{metric}{{{label}}}" for label in MATCHER_RE.findall(bare) if label not in known}
    return found


def _load_yaml(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    return data


def alert_rules() -> list[dict[str, Any]]:
    """Every alerting rule in the rules file, in file order."""
    return [rule for group in _load_yaml(ALERTS_FILE)["groups"] for rule in group["rules"] if "alert" in rule]


def dashboard() -> dict[str, Any]:
    """The dashboard's JSON model."""
    data: dict[str, Any] = json.loads(DASHBOARD_FILE.read_text(encoding="utf-8"))
    return data


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, including those folded inside collapsed rows."""
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def dashboard_queries() -> list[str]:
    """Every PromQL query of the dashboard: panel targets and template variables."""
    board = dashboard()
    queries = [target["expr"] for panel in all_panels(board["panels"]) for target in panel.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            queries += [variable["definition"], variable["query"]["query"]]
    return queries


def as_promql(query: str) -> str:
    """A dashboard query as plain PromQL: variables substituted, label_values() reduced to its selector."""
    for variable, value in GRAFANA_VARIABLES.items():
        query = query.replace(variable, value)
    if query.startswith("label_values("):
        query = query.removeprefix("label_values(").rsplit(",", 1)[0]
    return query


def _rule_id(rule: dict[str, Any]) -> str:
    return f"{rule['alert']}-{rule['labels']['severity']}"


def promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """Run promtool. CI installs it, so its absence fails the test rather than skipping it."""
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: install the `prometheus` package (apt-get install -y prometheus)")
    return subprocess.run(
        [path, *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
        timeout=PROMTOOL_TIMEOUT_S,
    )


# Rules ------------------------------------------------------------------------------------


def test_promtool_check_rules() -> None:
    result = promtool("check", "rules", ALERTS_FILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_test_rules() -> None:
    result = promtool("test", "rules", ALERTS_TEST_FILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_are_the_documented_set() -> None:
    assert {rule["alert"] for rule in alert_rules()} == ALERTS
    readme = README_FILE.read_text(encoding="utf-8")
    assert {name for name in ALERTS if f"`{name}`" not in readme} == set()


@pytest.mark.parametrize("rule", alert_rules(), ids=_rule_id)
def test_alert_has_severity_summary_description_and_for(rule: dict[str, Any]) -> None:
    assert rule["labels"]["severity"] in SEVERITIES
    assert rule["annotations"]["summary"].strip()
    assert rule["annotations"]["description"].strip()
    assert "for" in rule, "state `for:` even when it is 0m"


@pytest.mark.parametrize("rule", alert_rules(), ids=_rule_id)
def test_alert_description_names_its_subject_and_value(rule: dict[str, Any]) -> None:
    description = rule["annotations"]["description"]
    missing = [label for label in SUBJECT_LABELS[rule["alert"]] if f"$labels.{label}" not in description]
    assert missing == []
    # The value is the expression's ($value) or a related reading fetched by a template query.
    assert "$value" in description or "| query" in description


@pytest.mark.parametrize("rule", alert_rules(), ids=_rule_id)
def test_alert_uses_only_exported_metrics_and_labels(rule: dict[str, Any]) -> None:
    # Annotations count too: their template queries fail silently on a wrong name.
    text = "\n".join([rule["expr"], *rule["annotations"].values()])
    assert unknown_metrics(text) == set()
    assert unknown_labels(text) == set()


def test_unit_tests_fire_every_alert_and_check_quiet_cases() -> None:
    cases = [case for test in _load_yaml(ALERTS_TEST_FILE)["tests"] for case in test["alert_rule_test"]]
    fired = {
        (case["alertname"], alert["exp_labels"]["severity"])
        for case in cases
        for alert in case.get("exp_alerts") or []
    }
    assert {_rule_id(rule) for rule in alert_rules()} == {f"{name}-{severity}" for name, severity in fired}
    quiet = [case for case in cases if not case.get("exp_alerts")]
    assert len(quiet) >= 2


# The checker itself: a typo in a metric or label name must be caught.


@pytest.mark.parametrize(
    ("expr", "metrics", "labels"),
    [
        ('rate(edgellm_requests_total{status="500"}[5m])', set(), set()),
        (
            "histogram_quantile(0.95, sum by (le) (rate(edgellm_time_to_first_token_seconds_bucket[5m])))",
            set(),
            set(),
        ),
        ('up{job="edgellm"} == 0', set(), set()),
        ("rate(edgellm_request_total[5m])", {"edgellm_request_total"}, set()),
        ("edgellm_time_to_first_token_seconds > 1", {"edgellm_time_to_first_token_seconds"}, set()),
        ("edgellm_gpu_memory_used_bytes_total", {"edgellm_gpu_memory_used_bytes_total"}, set()),
        (
            'edgellm_gpu_throttle_active{reasons="hw_slowdown"}',
            set(),
            {"edgellm_gpu_throttle_active{reasons}"},
        ),
        ('edgellm_model_state{state=~"a|b=c", modle!="x"}', set(), {"edgellm_model_state{modle}"}),
        ('edgellm_queue_depth{le="1"}', set(), {"edgellm_queue_depth{le}"}),
    ],
)
def test_checker_catches_misspelled_names(expr: str, metrics: set[str], labels: set[str]) -> None:
    assert unknown_metrics(expr) == metrics
    assert unknown_labels(expr) == labels


# Dashboard ----------------------------------------------------------------------------------


def test_dashboard_is_a_current_grafana_model() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 36
    assert board["uid"]
    assert board["title"]


def test_dashboard_variables() -> None:
    variables = {variable["name"]: variable for variable in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    instance = variables["instance"]
    assert instance["type"] == "query"
    assert instance["datasource"] == DATASOURCE_REF
    assert instance["definition"] == "label_values(edgellm_build_info, instance)"
    assert instance["query"]["query"] == instance["definition"]


def test_dashboard_panel_ids_are_unique() -> None:
    ids = [panel["id"] for panel in all_panels(dashboard()["panels"])]
    assert len(ids) == len(set(ids))


def test_dashboard_panels_query_the_datasource_variable() -> None:
    for panel in all_panels(dashboard()["panels"]):
        if panel["type"] == "row":
            continue  # a row only groups panels: it runs no query and Grafana ignores its data source
        assert panel["datasource"] == DATASOURCE_REF, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", DATASOURCE_REF) == DATASOURCE_REF, panel["title"]


def test_dashboard_names_no_datasource_uid() -> None:
    def uids(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            if isinstance(node.get("datasource"), dict):
                yield node["datasource"].get("uid", "")
            for value in node.values():
                yield from uids(value)
        elif isinstance(node, list):
            for value in node:
                yield from uids(value)

    assert set(uids(dashboard())) == {"${datasource}"}
    assert "__inputs" not in dashboard()  # the datasource variable replaces import-time inputs


def test_dashboard_rows_and_layout() -> None:
    panels = dashboard()["panels"]
    assert [panel["title"] for panel in panels if panel["type"] == "row"] == ROWS
    boxes = [panel["gridPos"] for panel in all_panels(panels)]
    for box in boxes:
        assert box["x"] >= 0
        assert box["w"] > 0
        assert box["x"] + box["w"] <= 24
    cells = [
        (x, y)
        for box in boxes
        for x in range(box["x"], box["x"] + box["w"])
        for y in range(box["y"], box["y"] + box["h"])
    ]
    assert len(cells) == len(set(cells)), "panels overlap"


def test_dashboard_uses_only_exported_metrics_and_labels() -> None:
    queries = dashboard_queries()
    assert {name for query in queries for name in unknown_metrics(query)} == set()
    assert {label for query in queries for label in unknown_labels(query)} == set()


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    # promtool has no bare query parser: check the queries as recording rules instead.
    rules = [
        {"record": f"dashboard:query_{n}", "expr": as_promql(query)}
        for n, query in enumerate(dashboard_queries())
    ]
    assert [rule for rule in rules if "$" in rule["expr"]] == [], "a Grafana variable is left"
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}), encoding="utf-8")
    result = promtool("check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr
