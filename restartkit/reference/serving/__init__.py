"""The reference engine's serving surface: HTTP, the OpenAI protocol, the process's start-up and its sockets."""
