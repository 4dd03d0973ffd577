"""Retrievers that map search hits to pre-encoded document modules."""
