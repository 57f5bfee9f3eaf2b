"""The embedded registry's server: its in-memory state and the gRPC service that serves it."""
