"""A small JSON-over-HTTP client (stdlib only: the CLI must start fast)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request


class HTTPFailure(Exception):
    def __init__(self, url: str, status: int | None, message: str):
        super().__init__(f"{url}: {status or 'no answer'}: {message}")
        self.url, self.status, self.message = url, status, message


def request(method: str, url: str, body: dict | None = None, timeout: float = 10.0,
            headers: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        raw = e.read().decode(errors="replace")
        try:  # OpenAI's {"error": {"message"}}, or FastAPI's {"detail"}
            data = json.loads(raw)
            msg = (data.get("error") or {}).get("message") or data.get("detail") or raw
        except (ValueError, AttributeError):
            msg = raw
        raise HTTPFailure(url, e.code, str(msg)[:300]) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise HTTPFailure(url, None, str(reason)) from None
    try:
        return json.loads(raw or b"{}")
    except ValueError as e:
        raise HTTPFailure(url, 200, f"answer is not JSON: {e}") from None


def get(url: str, timeout: float = 10.0, headers: dict | None = None) -> dict:
    return request("GET", url, timeout=timeout, headers=headers)


def post(url: str, body: dict | None = None, timeout: float = 60.0, headers: dict | None = None) -> dict:
    return request("POST", url, body, timeout=timeout, headers=headers)
