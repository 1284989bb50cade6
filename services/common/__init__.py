"""Pieces every service shares: settings, structured logs, the gRPC server skeleton, errors."""
