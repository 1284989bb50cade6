"""The launcher: starts every service as a process, as `make up` does.

- `stack.py`: `Stack`, the whole topology as processes (what tests and benchmarks use);
- `service.py`: `Service`, one service's process and whether it serves;
- `credentials.py`: the tokens and TLS material a stack makes for its services;
- `ports.py`: free ports for the services to listen on;
- `main.py`: the command line (`python -m services.launcher`, `make up`).
"""
