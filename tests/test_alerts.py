"""The alert rules restartkit ships (docs/prometheus/restartkit-alerts.yml), run in Prometheus's own rule engine:
`promtool check rules` accepts them and `promtool test rules` fires each alert on the series restartkit writes and
keeps it silent where it should (tests/fixtures/prometheus/alerts-test.yml); every metric they name is one
restartkit writes."""
import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import tool

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "docs" / "prometheus" / "restartkit-alerts.yml"
TESTS = ROOT / "tests" / "fixtures" / "prometheus" / "alerts-test.yml"


def promtool() -> str:
    exe = tool("promtool")
    if exe is None:
        pytest.skip("no promtool (scripts/install-tools puts one in /opt/restartkit/tools/bin)")
    return exe


def test_promtool_checks_the_rules():
    r = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS: 6 rules found" in r.stdout, r.stdout + r.stderr


def test_promtool_test_rules_fires_each_alert_where_it_should():
    r = subprocess.run([promtool(), "test", "rules", TESTS.name], capture_output=True, text=True, timeout=120,
                       cwd=TESTS.parent)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    alerts = set(re.findall(r"- alert: (\w+)", RULES.read_text()))
    tested = set(re.findall(r"alertname: (\w+)", TESTS.read_text()))
    assert alerts == tested, alerts ^ tested


def test_every_metric_the_rules_name_is_one_restartkit_writes():
    source = (ROOT / "restartkit" / "record.py").read_text()
    for name in set(re.findall(r"restartkit_[a-z_]+", RULES.read_text())):
        assert f'"{name.removesuffix("_total")}"' in source, name
