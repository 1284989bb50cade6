"""A controller replica: many job lifecycles as asyncio tasks in one process."""
