"""The Grafana dashboard parses and queries only metrics the app exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from deployments.metrics import ALL

DASHBOARD = Path(__file__).resolve().parents[2] / "configs" / "grafana_dashboard.json"
SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def exported_name(series: str) -> str:
    """Ray exports a metric NAME as ray_NAME (+ _total for counters, _bucket/_sum/_count
    for histograms): map a queried series back to NAME."""
    assert series.startswith("ray_"), series
    name = series[len("ray_"):]
    for suffix in SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in ALL:
            return name[: -len(suffix)]
    return name


def test_every_queried_metric_is_exported():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert len(exprs) >= 15
    queried = {exported_name(m) for e in exprs for m in re.findall(r"\bray_[a-z_]+", e)}
    assert queried <= set(ALL), queried - set(ALL)
    # The panels cover what operators asked for.
    for needed in ("raygen_time_to_first_token_seconds", "raygen_inter_token_latency_seconds",
                   "tgi_queue_size", "tgi_batch_current_size", "raygen_kv_blocks_used",
                   "tgi_request_failure", "tgi_request_generated_tokens"):
        assert needed in queried
    for series in (m for e in exprs for m in re.findall(r"\bray_[a-z_]+", e)):
        kind = ALL[exported_name(series)].kind
        if series.endswith("_total"):
            assert kind == "counter", series
        if series.endswith(("_bucket", "_sum", "_count")):
            assert kind == "histogram", series
