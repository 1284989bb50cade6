"""The sim backend: clusters on the sim cloud, over its gRPC API."""
