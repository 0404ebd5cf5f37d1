"""Offline tools of the project (not imported by the serving path)."""
