"""Security every service shares: roles and the access policy (`access`), tokens,
certificates, TLS, authentication (`auth`) and the edge interceptor (`edge`)."""
