"""Reading Prometheus text expositions (prometheus_client's own parser) and linting them
with promtool."""

from __future__ import annotations

import subprocess

from prometheus_client.parser import text_string_to_metric_families

# The series names each metric type exposes (the parser strips _total from counter names);
# _created is left out: not every family has it, so no query may rely on it.
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_count", "_sum"),
    "summary": ("", "_count", "_sum"),
    "gauge": ("",),
    "unknown": ("",),
    "info": ("_info",),
    "stateset": ("",),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
}


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def series_names(text: str) -> set[str]:
    """Every series name the exposition declares, sampled or not (a labelled histogram with no
    observation yet still declares its _bucket, _count and _sum)."""
    return {f.name + s for f in families(text).values() for s in SUFFIXES[f.type]}


def samples(text: str, name: str, **labels: str) -> list:
    """Samples called `name` whose labels include `labels`."""
    return [
        s
        for f in families(text).values()
        for s in f.samples
        if s.name == name and labels.items() <= s.labels.items()
    ]


def value(text: str, name: str, **labels: str) -> float:
    found = samples(text, name, **labels)
    assert len(found) == 1, f"expected one {name}{labels}, found {found}"
    return found[0].value


def check_metrics(promtool: str, text: str) -> None:
    """promtool's linter: exit 0 and no finding."""
    out = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), (
        f"promtool check metrics: exit {out.returncode}\n{out.stdout}{out.stderr}"
    )
