"""Requests: sampling parameters, sequences, intake (validation and arrival release),
completions, and beam-search groups."""
