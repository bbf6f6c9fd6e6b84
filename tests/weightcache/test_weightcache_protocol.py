"""The weight cache's wire protocol and the engine-side loader's config: who may attach
(the daemon's own uid check, behind a 0700 socket dir) and what the loader refuses."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, ipc_policy, start_preload


def _another_uid(make_policy, sockdir, preloads):
    policy = ipc_policy(make_policy, sockdir)
    start_preload(policy, preloads)
    sock = next(p for p in sockdir.iterdir() if p.suffix == ".sock")
    # open the directory and socket so only the daemon's own uid check stands in the way
    os.chmod(sockdir, 0o755)
    os.chmod(sock, 0o777)
    code = ("import sys, os; from restartkit.weightcache import protocol; os.setgid(65534); os.setuid(65534);"
            f"r, fds = protocol.request({str(sock)!r}, {{'op': 'attach'}}); print(r['error'], r['message'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert "permission" in r.stdout and "uid 65534 may not use" in r.stdout, r.stderr
    # and with the default 0700 directory it cannot even reach the socket
    os.chmod(sockdir, 0o700)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert "PermissionError" in r.stderr


def test_another_uid_cannot_attach(make_policy, preloads):
    if os.getuid() != 0:
        pytest.skip("needs root to act as another user")
    import shutil
    import tempfile
    sockdir = Path(tempfile.mkdtemp(prefix="rk-uid-test-"))  # under /tmp: reachable by another user
    try:
        _another_uid(make_policy, sockdir, preloads)
    finally:
        for p in preloads:
            p.send_signal(signal.SIGTERM)
            p.wait(15)
        shutil.rmtree(sockdir, ignore_errors=True)


def test_bad_loader_config_is_refused():
    from restartkit.weightcache.loader import IPCConfig
    with pytest.raises(ValueError, match="true or false"):
        IPCConfig.parse({"fallback": "false"})
    with pytest.raises(ValueError, match="unknown ipc_cache key"):
        IPCConfig.parse({"fallbak": True})
