"""Metrics and timelines."""
