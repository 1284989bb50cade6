"""Pieces every service shares: settings, structured logs, the gRPC server skeleton, errors,
and security: the edge every server runs (edge.py: tokens from auth.py, the policy
table of access.py, TLS from tls.py) and the channels every client opens (channels.py).
"""
