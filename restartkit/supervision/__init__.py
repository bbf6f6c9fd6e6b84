"""What `restartkit supervise` (restartkit/commands/supervise.py) is made of, one job per module: the held
socket and its broker (held.py), the standby kept armed (standby_keeper.py), the start limit and its backoff
(start_limit.py), the probes of the watched engine (probes.py), the guard that survives a read-only state dir
(guard.py), supervisor.json and the one-supervisor lock (state.py), the first start's adoption and the plain cold start
when the restart flow itself fails (starts.py), a failure noticed (failure.py), and the end (ending.py)."""
