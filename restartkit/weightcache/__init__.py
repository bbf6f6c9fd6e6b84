"""The weight cache: one daemon per device keeps processed weights in memory
and hands them to a (re)started engine as one IPC handle per device."""
