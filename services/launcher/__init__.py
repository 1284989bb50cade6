"""The launcher: starts every service as a process, as `make up` does."""
