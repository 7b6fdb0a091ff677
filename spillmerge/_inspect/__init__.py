"""Inspecting either tree: summary and verify, coverage, status."""
