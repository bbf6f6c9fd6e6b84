"""The service's front (restartkit.front.proxy): it answers clients on the service's port and forwards to the
engine that serves, continuing a request in flight on the next engine when its engine dies."""
