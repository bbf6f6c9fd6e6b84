"""The standby's mechanism: the prepared-engine protocol (prepared) and the armed standby kept beside a service
(armed: arm, state, frozen, disarm), as snapshot/ is criu's and weightcache/ is ipc's."""
