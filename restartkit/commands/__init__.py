"""Whole commands, one module each, named after the command it implements: `supervise`, `bench`,
`demo`, `rollout`, and `reconcile` (what every guarded command runs first, with `guarded`).  The
CLI parses and prints; these do the work, callable from Python too."""
