"""Sandboxed shadow iterations: record a live rank's collectives, replay them on a standby."""
