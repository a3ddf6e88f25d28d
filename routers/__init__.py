"""Routers: which replica of a pool an arriving request joins (one file per router; see base.py)."""
