"""Saved values on the wire and their merge per finished request."""
