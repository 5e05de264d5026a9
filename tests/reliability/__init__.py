"""Reliability suite: load, soak, faults and abuse against a real edgellmd process (marker `reliability`)."""
