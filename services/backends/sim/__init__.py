"""The sim backend: clusters on the sim cloud, over its gRPC API.

`backend` (the calls), `plans` (a launch plan as a Launch call), `batching` (calls
asked for at once sent as one), `observing` (records and events as observations)
and `errors` (the cloud's refusals as the backend's errors).
"""
