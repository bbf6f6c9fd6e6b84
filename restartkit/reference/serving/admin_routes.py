"""The reference engine's admin routes (restartkit's own calls: its admin token, restartkit.guard.admin): stats,
the KV cache and the weights let go and taken back for a snapshot (through the scheduler), the held socket given up for a dump.  Mixed
into the HTTP handler (restartkit.reference.serving.api.Handler), as the OpenAI routes are."""
from __future__ import annotations

import os

from restartkit.guard.admin import ADMIN_HEADER

# admin routes that act on the loaded model (its KV cache, its weights)
ENGINE_ROUTES = ("/admin/drop_kv_cache", "/admin/release_weights", "/admin/reattach_weights", "/admin/restore_kv_cache")


class AdminRoutes:
    def _admin_post(self, path: str, body: dict | None) -> None:
        """POST /admin/...: the caller's token was checked (_admin_ok)."""
        st = self.server.state
        if path == "/admin/detach_listener":
            self._admin_detach()
        elif path == "/admin/drop_kv_cache":
            self._admin_drop_kv()
        elif path == "/admin/release_weights":
            st.ready = False
            try:
                self._send(200, st.scheduler.release_weights())
            except ValueError as e:
                st.ready = st.engine.model is not None
                self._error(409, str(e), "conflict")
        elif path == "/admin/reattach_weights":
            fallback = bool((body or {}).get("fallback", False))
            try:
                info = st.scheduler.reattach_weights(fallback=fallback)
            except RuntimeError as e:  # the loader: the weight cache is gone or holds other weights
                self._error(409, str(e), "conflict")
                return
            st.ready = True
            self._send(200, {"load": info, "kv_cache_bytes": st.engine.model.kv_cache_bytes})
        elif path == "/admin/restore_kv_cache":
            st.scheduler.restore_kv_cache()
            st.ready = True
            self._send(200, {"kv_cache_bytes": st.engine.model.kv_cache_bytes})
        else:
            self._error(404, f"no route {path}")

    def _admin_detach(self) -> None:
        """Give up the held socket; it is taken back from the supervisor's broker, whose address follows from the
        admin token (restartkit.guard.admin.broker_name): never from the request."""
        st = self.server.state
        if st.listeners is None:
            self._error(409, "this engine serves no held socket (a standby promoted to serve, or one started on a "
                             "port of its own)", "conflict")
            return
        if st.admin_token is None:
            self._error(409, "this engine was started without restartkit's admin token: it has no broker to take "
                             "the held socket back from", "conflict")
            return
        from restartkit.guard.admin import broker_name
        try:
            self._send(200, {"admin_port": st.listeners.detach(broker_name(st.admin_token))})
        except RuntimeError as e:  # detach.DetachError: nothing to give up
            self._error(409, str(e), "conflict")

    def _from_this_host(self) -> bool:
        """Loopback, or this host calling the specific address the server binds (restartkit does
        that when [service] host names one): another host cannot open a TCP connection from it."""
        client = self.client_address[0]
        bound = self.server.server_address[0]
        return client in ("127.0.0.1", "::1") or client.startswith("127.") or (
            bound not in ("0.0.0.0", "::", "") and client == bound)

    def _admin_sent(self) -> bool:
        """The request carries restartkit's admin token (False where the engine has none)."""
        import hmac
        token = self.server.state.admin_token
        return token is not None and hmac.compare_digest((self.headers.get(ADMIN_HEADER) or "").encode(),
                                                         token.encode())

    def _admin_ok(self) -> bool:
        """Admin calls (stats, sleep and wake, KV-cache drop, weights release, the held socket) carry restartkit's
        admin token when the engine has one (and the API key too, when one is set); an engine started by hand
        without one answers them on loopback only.  A 403 otherwise: an address is not a credential."""
        import hmac
        st = self.server.state
        if st.admin_token is None:
            if self._from_this_host():
                return True
            self._error(403, "admin endpoints answer on loopback only", "forbidden")
            return False
        key_ok = st.api_key is None or hmac.compare_digest((self.headers.get("Authorization") or "").encode(),
                                                           f"Bearer {st.api_key}".encode())
        if self._admin_sent() and key_ok:
            return True
        self.close_connection = True
        self._error(403, "admin endpoints answer restartkit's own calls only (its admin token, in the service's "
                         "state dir)", "forbidden")
        return False

    def _stats(self) -> dict:
        st = self.server.state
        eng = st.engine
        out = {
            "pid": os.getpid(), "ready": st.ready and not st.stopping, "model": st.model_name,
            "phases": st.phases, "requests": st.requests,
            "started_at": st.started_at, "ready_at": st.ready_at,
            # behind the front: connections of other users refused (restartkit.guard.peer); None: open to all
            "owner_only": None if self.server.owners is None else {"refused": self.server.refused},
        }
        if st.sleeper is not None:
            out["sleep"] = {"enabled": True, "level": st.sleeper.level, "last": st.sleeper.last}
        if eng is not None and eng.model is not None:
            out.update(load=eng.load_info, device=str(eng.device), dtype=str(eng.dtype).replace("torch.", ""),
                       # can a new engine serve beside it on its port (an overlapped hand-over)?
                       reuse_port=getattr(self.server, "reuse_port", False) or st.prepared_mode or self.server.held,
                       held_socket=self.server.held,
                       weight_bytes=eng.weight_bytes(), kv_cache_bytes=eng.model.kv_cache_bytes,
                       cuda_graph=eng._graphs is not None,
                       # mixed steps as graphs between their chunks' attention (restartkit.reference.runtime.piecewise)
                       mixed_graphs=None if eng._pieces is None else dict(eng._pieces.counts))
        if st.scheduler is not None:
            s = st.scheduler
            running, waiting = s.depth
            out["scheduler"] = {"running": running, "waiting": waiting, "max_num_seqs": s.max_num_seqs,
                                "max_num_batched_tokens": s.max_batched_tokens, "max_queued_seqs": s.max_waiting,
                                "kv_cache_blocks": eng.kv_blocks, "kv_blocks_free": eng.free_blocks(), **s.counts}
            if eng.draft is not None:
                out["speculative"] = {"draft_model": eng.draft.options.model, "tokens": eng.spec_tokens,
                                      **eng.spec_counts}
        try:  # resident pages (psutil's import alone costs tens of ms on a busy start)
            with open("/proc/self/statm") as f:
                out["rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            pass
        return out

    def _admin_drop_kv(self):
        self.server.state.ready = False
        freed = self.server.state.scheduler.drop_kv_cache()
        self._send(200, {"freed_bytes": freed})
