"""The reference engine's log: a client that closes before its answer is one line, not a traceback."""
import json
import socket
import struct
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.helpers import ROOT, free_port

pytestmark = pytest.mark.slow


def test_a_client_that_closes_early_is_one_log_line(tiny_model, tmp_path):
    port, log = free_port(), tmp_path / "engine.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "restartkit.reference.serving.server", "--model", str(tiny_model),
                                 "--port", str(port), "--max-model-len", "256", "--threads", "1"], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        end = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < end, log.read_text()
                time.sleep(0.1)
        body = json.dumps({"model": "tiny", "prompt": "once upon a time", "max_tokens": 200, "stream": True,
                           "ignore_eos": True}).encode()
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port)) as c:
                c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(body) + body)
                assert c.recv(64).startswith(b"HTTP/1.")  # it has started answering
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        end = time.monotonic() + 60
        while log.read_text().count("closed before its answer") < 3:
            assert time.monotonic() < end, log.read_text()
            time.sleep(0.1)
        # the engine still serves
        r = urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=json.dumps({"model": "tiny", "prompt": "hi",
                                                                        "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json"}), timeout=60)
        assert r.status == 200
    finally:
        proc.terminate()
        proc.wait(30)
    text = log.read_text()
    assert "Traceback" not in text and "BrokenPipe" not in text.replace("(BrokenPipeError)", ""), text
