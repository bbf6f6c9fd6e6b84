"""Guards around every command that changes a service: the state dir proven writable before
anything is touched (preflight), one command at a time per service (lock), what the command is
about to do written down first (intent), termination signals deferred to the next safe point
(deferred).  A floor of the house: it imports only restartkit.process and the small helpers."""
