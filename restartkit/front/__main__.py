"""python -m restartkit.front --fd N | --listen HOST:PORT --upstream http://127.0.0.1:PORT"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys

from aiohttp import web

from restartkit.front.proxy import Front

SHUTDOWN_S = 2.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m restartkit.front")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--fd", type=int, help="a listening socket given to the front (held by supervise)")
    where.add_argument("--listen", help="HOST:PORT to bind")
    ap.add_argument("--upstream", required=True, help="the engine's address, e.g. http://127.0.0.1:8001")
    ap.add_argument("--wait-s", type=float, default=60.0, help="how long a request waits for an engine")
    ap.add_argument("--max-in-flight", type=int, default=4096, help="requests held at once; past it: 503")
    ap.add_argument("--counts-file", help="where the counts are kept for the next front (supervise's state dir)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="front: %(message)s")  # aiohttp's errors, if any
    if a.fd is not None:
        sock = socket.socket(fileno=a.fd)
    else:
        host, _, port = a.listen.rpartition(":")
        sock = socket.create_server((host or "127.0.0.1", int(port)), reuse_port=False, backlog=1024)
    sock.setblocking(False)
    front = Front(a.upstream, a.wait_s, a.max_in_flight, say=lambda m: print(m, file=sys.stderr, flush=True),
                  counts_file=a.counts_file)
    try:  # uvloop where installed (it comes with vLLM's uvicorn[standard]): a third less time per request
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    asyncio.run(_serve(front, sock))
    return 0


async def _serve(front: Front, sock: socket.socket) -> None:
    # a stopped front waits SHUTDOWN_S for its requests in flight (supervise starts the next one on the same socket)
    runner = web.AppRunner(front.app(), access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_S)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    print(f"front: answering on {sock.getsockname()[0]}:{sock.getsockname()[1]}, forwarding to {front.upstream}",
          file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())
