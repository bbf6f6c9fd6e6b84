"""`[criu] refresh` read as systemd reads a calendar (checked against `systemd-analyze calendar` over
many expressions), and the crontab line made from the same schedule, or refused with the reason."""
import random
import shutil
import subprocess

import pytest

from restartkit.policy.schedule import UNASKED, ScheduleError, check, parsed_check, systemd_check, to_cron
from tests.helpers import run_cli

HAVE_ANALYZE = shutil.which("systemd-analyze") is not None


@pytest.mark.parametrize("schedule,cron", [
    ("daily", "0 0 * * *"), ("hourly", "0 * * * *"), ("weekly", "0 0 * * 1"), ("monthly", "0 0 1 * *"),
    ("quarterly", "0 0 1 1,4,7,10 *"), ("Mon..Fri 02:00", "0 2 * * 1-5"), ("*-*-* 04:30:00", "30 4 * * *"),
    ("Sat,Sun 3:15", "15 3 * * 0,6"), ("*:0/15", "0-59/15 * * * *"), ("*:5..10/2", "5-10/2 * * * *"), ("*-01,07-01 00:00", "0 0 1 1,7 *"),
])
def test_the_cron_line_runs_at_the_schedules_times(schedule, cron):
    assert check(schedule) is None
    assert to_cron(schedule) == cron


@pytest.mark.parametrize("schedule,why", [
    ("2026-*-01 00:00", "no year"), ("*-02~01", "end of the month"), ("Mon *-*-1", "OR the weekday"),
    ("*-*-* 04:30:15", "whole minutes"), ("03:00 UTC", "time zone"),
])
def test_what_cron_cannot_express_is_refused_with_the_reason(schedule, why):
    assert check(schedule) is None  # a fine timer
    with pytest.raises(ScheduleError, match=why):
        to_cron(schedule)


@pytest.mark.parametrize("schedule", ["every day", "25:00", "*-13-01", "Fri..Mon 1:00", " daily", "UTC", "Mon.."])
def test_what_systemd_refuses_is_refused(schedule):
    assert check(schedule) is not None


@pytest.mark.skipif(not HAVE_ANALYZE, reason="no systemd-analyze")
def test_the_grammar_agrees_with_systemd_analyze_over_many_expressions():
    rng = random.Random(7)
    atoms = ["*", "0", "00", "1", "5", "12", "13", "23", "24", "31", "32", "59", "60", "1..5", "5..1", "0/15", "1,15",
             "~1", "1.5", "", "x", "2026", "1969", "2200", "7/0", "01,04"]
    days = ["", "Mon", "Mon..Fri", "Fri..Mon", "Sat,Sun", "monday", "Mo", "Sun..Sat", "Mon,Wed..Fri", "Tue.."]
    zones = ["", "UTC", "Europe/Berlin", "Mars/Base"]
    exprs = {"daily", "Daily", "*-*-* *:*:*", "*-02~01", "2026-02~03 00:00", "mon *~24 UTC"}
    while len(exprs) < 400:
        parts = [d for d in [rng.choice(days)] if d]
        if rng.random() < .6:
            parts.append(rng.choice("-~-").join(rng.choice(atoms) for _ in range(rng.choice([2, 3]))))
        if rng.random() < .8:
            parts.append(":".join(rng.choice(atoms) for _ in range(rng.choice([2, 3]))))
        parts += [z for z in [rng.choice(zones)] if z]
        exprs.add(" ".join(parts))
    exprs |= set(CORPUS)
    disagree = [(e, parsed_check(e), systemd_check(e)) for e in sorted(exprs)
                if (parsed_check(e) is None) != (systemd_check(e) is None)]
    assert disagree == []


# what systemd 252 says of these (each checked with systemd-analyze calendar): None = accepted
CORPUS = {
    "daily Europe/Berlin": None, "weekly UTC": None, "semi-annually": None, "Semi-Annually": None,
    "semiannually": None, "hourly Europe/Berlin": None, "minutely UTC": None, "annually UTC": None,
    "*:0/115": "repeats", "*:0/59": None, "*:0/60": "repeats", "0/23:00": None, "0/24:00": "repeats",
    "*-*-1/30": None, "*-*-1/31": "repeats", "*-1/11-01": None, "*-1/12-01": "repeats", "*:29/30": None,
    "*:30/30": "repeats", "*:5..10/2": None, "2025/2-01-01": None, "2025/200-01-01": "repeats",
    "*-*-~1/5": "is not a systemd calendar", "*:5..10/60": None, "*:10..5/2": "outside", "daily UTC UTC": "only a time zone", "weekly Mon": "only a time zone",
    "Mon daily": "cannot read",
}


@pytest.mark.parametrize("expr", sorted(CORPUS))
def test_the_parser_gives_systemd_252s_verdict_on_the_corpus(expr):
    """Where systemd-analyze is absent (a container), this module's parser decides: it must agree."""
    got = parsed_check(expr)
    assert (got is None) == (CORPUS[expr] is None) and (got is None or CORPUS[expr] in got), got
    if HAVE_ANALYZE:
        assert (systemd_check(expr) is None) == (CORPUS[expr] is None)
        assert check(expr) == systemd_check(expr)  # systemd's verdict where it can be asked
    else:
        assert systemd_check(expr) is UNASKED and check(expr) == parsed_check(expr)


def test_policy_check_refuses_a_calendar_systemd_would_not_load(make_policy):
    policy = make_policy(extra='\n[criu]\nrefresh = "every day"\n')
    r = run_cli("policy", "check", policy)
    assert r.returncode == 2 and "'every day' is not a systemd calendar expression" in r.stderr, r.stderr


@pytest.mark.parametrize("schedule,cron", [("Mon..Fri 02:00", "0 2 * * 1-5"), ("*-*-* 04:30:15", None)])
def test_install_timer_writes_units_systemd_loads_and_the_same_schedule_for_cron(make_policy, tmp_path, schedule, cron):
    policy = make_policy(extra=f'\n[criu]\nrefresh = "{schedule}"\n')
    units = tmp_path / "units"
    units.mkdir()
    r = run_cli("snapshot", "refresh", "--policy", policy, "--install-timer", "--unit-dir", units)
    assert r.returncode == 0, r.stderr
    if cron:
        line = next(ln for ln in r.stdout.splitlines() if "cron" in ln)
        assert line.split(": ", 1)[1].startswith(f"{cron} root "), line
    else:
        assert "cron cannot run [criu] refresh = '*-*-* 04:30:15': cron runs at whole minutes only" in r.stdout
    timer = (units / "restartkit-refresh-svc.timer").read_text()
    assert f"OnCalendar={schedule}\n" in timer
    assert "After=restartkit-svc.service" in (units / "restartkit-refresh-svc.service").read_text()
    if HAVE_ANALYZE:
        v = subprocess.run(["systemd-analyze", "verify", str(units / "restartkit-refresh-svc.timer")],
                           capture_output=True, text=True)
        assert v.returncode == 0, v.stderr
