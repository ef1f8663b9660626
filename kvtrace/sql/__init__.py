"""Shipped forensics queries, one per ``.sql`` file (package data)."""
