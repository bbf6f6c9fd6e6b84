"""`restartkit audit`: find what an engine upgrade removed, renamed or gated
in a deploy repository, before the restart that would trip on it.

The rules are data (rules/<engine>.json, one file per engine); a new engine
release is a data change.  Scanned: shell scripts, systemd units, YAML and
compose files, Dockerfiles, env files, Python files and restartkit policies.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from restartkit.errors import UsageError

RULES_DIR = Path(__file__).parent / "rules"
SKIP_DIRS = {".git", ".hg", ".svn", "node_modules", ".venv", "venv", "__pycache__", ".tox", ".mypy_cache", "site-packages"}
MAX_BYTES = 2 << 20
KIND_BY_SUFFIX = {".sh": "shell", ".bash": "shell", ".service": "systemd", ".socket": "systemd", ".timer": "systemd",
                  ".yaml": "yaml", ".yml": "yaml", ".py": "python", ".toml": "policy", ".env": "env", ".conf": "systemd",
                  ".json": "json"}
COMMENT = {"shell": "#", "systemd": "#", "yaml": "#", "python": "#", "policy": "#", "env": "#", "docker": "#"}


@dataclass
class Finding:
    path: str
    line: int
    rule: str
    kind: str
    severity: str
    versions: str
    what: str
    action: str
    text: str


def load_rules(engine: str) -> list[dict]:
    path = RULES_DIR / f"{engine}.json"
    if not path.exists():
        known = ", ".join(p.stem for p in RULES_DIR.glob("*.json"))
        raise UsageError(f"no audit rules for engine {engine!r}", hint=f"engines with rules: {known}")
    rules = json.loads(path.read_text())["rules"]
    for r in rules:
        r["_re"] = re.compile(r["pattern"])
        for key in ("if_file_contains", "unless_file_contains"):
            if key in r:
                r[f"_{key}"] = re.compile(r[key])
    return rules


def _v(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split("."))
    except ValueError:
        raise UsageError(f"version {s!r} is not a version number", hint="write it like 0.29 or 0.31.1") from None


def in_window(rule: dict, since: str | None, until: str | None) -> bool:
    """Does the change (rule.since..rule.until) fall inside the upgrade (since, until]?"""
    lo, hi = _v(rule["since"]), _v(rule["until"])
    if since and hi <= _v(since):
        return False
    if until and lo > _v(until):
        return False
    return True


def file_kind(path: Path) -> str | None:
    name = path.name
    if name == "Dockerfile" or name.startswith("Dockerfile.") or name.endswith(".dockerfile"):
        return "docker"
    if name == ".env" or name.endswith(".env"):
        return "env"
    kind = KIND_BY_SUFFIX.get(path.suffix)
    if kind:
        return kind
    if not path.suffix:
        try:
            with open(path, "rb") as f:
                head = f.read(64)
        except OSError:
            return None
        if head.startswith(b"#!") and (b"sh" in head.split(b"\n")[0] or b"python" in head.split(b"\n")[0]):
            return "python" if b"python" in head.split(b"\n")[0] else "shell"
    return None


def walk(root: Path):
    if root.is_file():
        yield root
        return
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for fn in filenames:
            yield Path(dirpath) / fn


def audit(root: str | os.PathLike, engine: str = "vllm", since: str | None = None, until: str | None = None) -> dict:
    root = Path(root)
    if not root.exists():
        raise UsageError(f"{root} does not exist", hint="give the deploy repository's directory")
    rules = [r for r in load_rules(engine) if in_window(r, since, until)]
    files = []
    for path in walk(root):
        kind = file_kind(path)
        if kind is None:
            continue
        try:
            if path.stat().st_size > MAX_BYTES:
                continue
            text = path.read_text(errors="replace")
        except OSError:
            continue
        files.append((path, kind, text))
    repo_text_has = {}
    findings: list[Finding] = []
    for path, kind, text in files:
        if kind == "policy" and "[service]" not in text:
            continue  # a TOML file that is not a restartkit policy
        for r in rules:
            if "kinds" in r and kind not in r["kinds"]:
                continue
            if not r["_re"].search(text):
                continue
            if "_if_file_contains" in r and not r["_if_file_contains"].search(text):
                continue
            if "_unless_file_contains" in r and r["_unless_file_contains"].search(text):
                continue
            if "unless_repo_contains" in r:
                needle = r["unless_repo_contains"]
                if needle not in repo_text_has:
                    repo_text_has[needle] = any(needle in t for _, _, t in files)
                if repo_text_has[needle]:
                    continue
            prefix = COMMENT.get(kind)
            for i, line in enumerate(text.splitlines(), 1):
                if prefix and line.lstrip().startswith(prefix):
                    continue  # a commented-out line changes nothing at restart
                if r["_re"].search(line):
                    findings.append(Finding(str(path.relative_to(root) if root.is_dir() else path), i, r["id"], r["kind"],
                                            r["severity"], r["since"] if r["since"] == r["until"] else f"{r['since']}-{r['until']}",
                                            r["what"], r["action"], line.strip()[:200]))
                    if r.get("once_per_file"):
                        break
    findings.sort(key=lambda f: (f.path, f.line, f.rule))
    needs_action = sum(1 for f in findings if f.severity == "action")
    return {"engine": engine, "from": since, "to": until, "root": str(root), "files_scanned": len(files),
            "rules": len(rules), "needs_action": needs_action, "findings": [asdict(f) for f in findings]}


def render(result: dict) -> str:
    lines = []
    for f in result["findings"]:
        tag = "ACTION" if f["severity"] == "action" else "info"
        lines.append(f"{f['path']}:{f['line']}: {tag} [{result['engine']} {f['versions']}, {f['kind']}] {f['what']}\n"
                     f"    {f['text']}\n    -> {f['action']}")
    lines.append(f"{result['files_scanned']} files scanned, {len(result['findings'])} findings, "
                 f"{result['needs_action']} need action")
    return "\n".join(lines)
