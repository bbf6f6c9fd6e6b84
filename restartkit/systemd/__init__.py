"""The systemd edge: the units restartkit writes (units) and the notify protocol supervise speaks (notify)."""
