"""Alembic migrations (installed as app.migrations; app/db/migrate.py runs them)."""
