"""The layer between the scheduler's store and its database (contract §2).

`Database` runs transactions handed to it as synchronous SQLAlchemy Core
functions (`database.py`); `turns.py` orders the writers; `sqlite.py` is what
the default SQLite file needs (its writer thread, its checkpoints, its
durability setting).
"""

from services.scheduler.db.database import Database, OutcomeUnknown, normalize_url, run_read
from services.scheduler.db.sqlite import SYNCHRONOUS, check_synchronous, default_url

__all__ = [
    "SYNCHRONOUS",
    "Database",
    "OutcomeUnknown",
    "check_synchronous",
    "default_url",
    "normalize_url",
    "run_read",
]
