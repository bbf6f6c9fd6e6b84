"""`[criu] refresh`: a systemd calendar expression (systemd.time(7)), read here the way systemd reads
it, so that a schedule systemd would refuse fails `policy check` instead of the timer, and the
crontab line restartkit prints runs at the same times or is refused with the reason.

    [weekday] [[year-]month-day] [hour:minute[:second]] [timezone]   or a shorthand (daily, ...)

Each field: `*`, a value, a list (`1,15`), a range (`1..5`), a repetition (`0/15`: from 0 every 15);
the day may count from the month's end (`*-02~01`: the last day of February).  `systemd-analyze calendar` has the last word
where it exists: `check`, behind both `policy check` and the timer install, asks it, and reads the
expression itself (`parsed_check`, kept equal to systemd 252 on the tests' corpus) only where it is absent."""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

SHORTHANDS = {  # what systemd expands them to
    "minutely": "*-*-* *:*:00", "hourly": "*-*-* *:00:00", "daily": "*-*-* 00:00:00",
    "weekly": "Mon *-*-* 00:00:00", "monthly": "*-*-01 00:00:00", "yearly": "*-01-01 00:00:00",
    "annually": "*-01-01 00:00:00", "quarterly": "*-01,04,07,10-01 00:00:00",
    "semiannually": "*-01,07-01 00:00:00", "semi-annually": "*-01,07-01 00:00:00",
}
DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
FULL_DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
LIMITS = {"year": (1970, 2199), "month": (1, 12), "day": (1, 31), "hour": (0, 23), "minute": (0, 59),
          "second": (0, 59)}
ITEM = re.compile(r"(?P<start>~?\d+(?:\.\d+)?)(?:\.\.(?P<end>\d+(?:\.\d+)?))?(?:/(?P<step>\d+(?:\.\d+)?))?")


class ScheduleError(ValueError):
    pass


@dataclass(frozen=True)
class Calendar:
    """One expression, parsed: each field `*` or its items as written (`1..5`, `0/15`, `~1`)."""
    weekdays: tuple[int, ...] | None  # 0 = Monday; None: any day
    year: str
    month: str
    day: str
    hour: str
    minute: str
    second: str
    timezone: str | None


def parse(text: str) -> Calendar:
    """ScheduleError naming what is wrong, as systemd would refuse it."""
    expr = text if text.strip() == text and not any(ord(c) < 32 or ord(c) == 127 for c in text) else None
    if not expr or len(expr) > 200:
        raise ScheduleError("is empty, too long, has spaces around it or a control character in it")
    words = expr.split()
    if words[0].lower() in SHORTHANDS:  # a shorthand, perhaps with a time zone ("daily Europe/Berlin")
        if len(words) > 2 or (len(words) == 2 and not _timezones(words[1])):
            raise ScheduleError(f"{words[0]!r} stands for a whole schedule: only a time zone may follow it")
        words = SHORTHANDS[words[0].lower()].split() + words[1:]
    weekdays = None
    if words and re.fullmatch(r"[A-Za-z.,]+", words[0]) and words[0].lower() not in _timezones(words[0]):
        weekdays = _weekdays(words.pop(0))
    date = time = zone = None
    for i, w in enumerate(words):
        if ":" in w and time is None:
            time = w
        elif ("-" in w or "~" in w) and date is None and time is None and not _timezones(w):
            date = w
        elif i == len(words) - 1 and _timezones(w):
            zone = w
        else:
            raise ScheduleError(f"cannot read {w!r} (a weekday, then year-month-day, then hour:minute[:second], "
                                "then a time zone)")
    if weekdays is None and date is None and time is None:
        raise ScheduleError("names no weekday, date or time")
    y, mo, d = _split(date or "*-*-*", "-", ("year", "month", "day"), 3)
    h, mi, s = _split(time or "00:00:00", ":", ("hour", "minute", "second"), 3)
    return Calendar(weekdays, y, mo, d, h, mi, s, zone)


EXAMPLES = "say 'daily', 'Mon..Fri 02:00', '*-*-* 04:30:00', 'weekly Europe/Berlin'"
UNASKED = object()  # systemd-analyze is not here, or did not answer


def check(text: str) -> str | None:
    """Why `text` is no calendar systemd accepts (None: it is one): `policy check` and the timer install
    both ask this.  systemd's own verdict where `systemd-analyze` is installed, else this module's."""
    verdict = systemd_check(text)
    return parsed_check(text) if verdict is UNASKED else verdict


def parsed_check(text: str) -> str | None:
    """This module's verdict, systemd 252's rules (for hosts without systemd-analyze: a container)."""
    try:
        parse(text)
        return None
    except ScheduleError as e:
        return f"{_cut(text)} is not a systemd calendar expression: {e} ({EXAMPLES})"


def systemd_check(text: str):
    """`systemd-analyze calendar`'s verdict: None (accepted), why not, or UNASKED."""
    exe = shutil.which("systemd-analyze")
    if exe is None or any(ord(c) < 32 for c in text):  # a control character: never an argument
        return UNASKED if exe is None else parsed_check(text)
    try:
        r = subprocess.run([exe, "calendar", "--", text], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return UNASKED
    if r.returncode == 0:
        return None
    said = " ".join((r.stderr or r.stdout).strip().splitlines()[-1:]).replace(text, "it")[:120]
    return f"{_cut(text)} is not a systemd calendar expression: systemd-analyze calendar says {said!r} ({EXAMPLES})"


def _cut(text: str) -> str:
    """The expression for a message: its repr, at most 60 characters of it."""
    return repr(text) if len(text) <= 60 else repr(text[:60]) + f"... ({len(text)} characters)"


def period_s(text: str) -> float | None:
    """Seconds between the schedule's next two elapses, by `systemd-analyze calendar` (None: not asked)."""
    from datetime import datetime
    exe = shutil.which("systemd-analyze")
    if exe is None or check(text):
        return None
    try:
        r = subprocess.run([exe, "calendar", "--iterations=2", "--", text], capture_output=True, text=True, timeout=10)
        when = [datetime.strptime(" ".join(ln.split(":", 1)[1].split()[1:3]), "%Y-%m-%d %H:%M:%S")
                for ln in r.stdout.splitlines() if ln.strip().startswith(("Next elapse:", "Iter. #2:"))]
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None
    return (when[1] - when[0]).total_seconds() if len(when) == 2 else None


def to_cron(text: str) -> str:
    """The five time fields of a crontab line for the same times; ScheduleError saying why cron cannot."""
    c = parse(text)
    if c.timezone:
        raise ScheduleError(f"cron has no time zone per line ({c.timezone}): drop it, or use the systemd timer")
    if c.year != "*":
        raise ScheduleError("cron has no year")
    if c.second not in ("0", "00"):
        raise ScheduleError("cron runs at whole minutes only (the seconds must be 00)")
    if c.weekdays is not None and c.day != "*":
        raise ScheduleError("cron runs when the day of the month OR the weekday matches; systemd, when both do")
    fields = [_cron_field(v, name) for v, name in ((c.minute, "minute"), (c.hour, "hour"), (c.day, "day"),
                                                   (c.month, "month"))]
    fields.append("*" if c.weekdays is None else _runs(sorted((d + 1) % 7 for d in c.weekdays)))
    return " ".join(fields)


def _runs(values: list[int]) -> str:
    """1,2,3,5 -> 1-3,5"""
    out, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(f"{values[i]}-{values[j]}" if j - i >= 2 else ",".join(map(str, values[i:j + 1])))
        i = j + 1
    return ",".join(out)


# ---- the parts -----------------------------------------------------------------------------------
def _weekdays(word: str) -> tuple[int, ...]:
    out: list[int] = []
    for part in word.split(","):
        ends = part.split("..")
        if len(ends) > 2 or not all(ends):
            raise ScheduleError(f"cannot read the weekday {part!r}")
        a, b = (_day(e) for e in (ends[0], ends[-1]))
        if b < a:
            raise ScheduleError(f"the weekdays {part!r} run backwards (say Mon..Fri, or Fri,Sat,Sun,Mon)")
        out += range(a, b + 1)
    return tuple(sorted(set(out)))


def _day(name: str) -> int:
    n = name.lower()
    if n in DAYS:
        return DAYS.index(n)
    if n in FULL_DAYS:
        return FULL_DAYS.index(n)
    raise ScheduleError(f"{name!r} is not a weekday (Mon, Tue, ... or Monday, ...)")


def _split(word: str, sep: str, names: tuple[str, ...], n: int) -> list[str]:
    if sep == "-" and "~" in word:  # month~day: the day counted from the month's end
        head, _, last = word.rpartition("~")
        parts = [*head.split("-"), "~" + last]
    else:
        parts = word.split(sep)
    if len(parts) == n - 1:  # month-day, hour:minute
        parts = ["*", *parts] if sep == "-" else [*parts, "00"]
    if len(parts) != n:
        raise ScheduleError(f"{word!r} needs {n - 1} or {n} fields separated by {sep!r}")
    for part, name in zip(parts, names):
        _field(part, name)
    return parts


def _field(part: str, name: str) -> None:
    if part == "*":
        return
    lo, hi = LIMITS[name]
    for item in part.split(","):
        if name == "year" and re.fullmatch(r"\d\d?(\.\.\d\d?)?", item):
            continue  # two digits: 1970 + (70..99), 2000 + (0..69), as systemd reads them
        m = ITEM.fullmatch(item)
        if not m or ("." in m["start"] and name != "second") or (m["start"].startswith("~") and name != "day"):
            raise ScheduleError(f"cannot read the {name} {item!r}")
        start = float(m["start"].lstrip("~"))
        end = float(m["end"]) if m["end"] else start
        if not (lo <= start <= hi and lo <= end <= hi) or end < start:
            raise ScheduleError(f"the {name} {item!r} is outside {lo}..{hi}")
        if m["step"] is not None:
            if float(m["step"]) <= 0:
                raise ScheduleError(f"the {name} {item!r} repeats every 0")
            if m["start"].startswith("~"):
                raise ScheduleError(f"the {name} {item!r}: a day from the month's end does not repeat")
            if not m["end"] and start + float(m["step"]) > hi:  # systemd: a repetition falls inside the field
                raise ScheduleError(f"the {name} {item!r} repeats past {hi}")


def _cron_field(part: str, name: str) -> str:
    if part == "*":
        return "*"
    out = []
    for item in part.split(","):
        m = ITEM.fullmatch(item)
        if m["start"].startswith("~"):
            raise ScheduleError("cron cannot count days from the end of the month (~)")
        start = int(m["start"])
        if m["end"]:
            out.append(f"{start}-{int(m['end'])}" + (f"/{int(m['step'])}" if m["step"] else ""))
        elif m["step"]:
            out.append(f"{start}-{LIMITS[name][1]}/{int(m['step'])}")
        else:
            out.append(str(start))
    return ",".join(out)


def _timezones(word: str) -> set[str]:
    """`word`, lowercased, when it names a time zone this host knows (systemd reads them from tzdata)."""
    from pathlib import Path
    if word.upper() == "UTC" or ("/" in word and ".." not in word and (Path("/usr/share/zoneinfo") / word).is_file()):
        return {word.lower()}
    return set()
