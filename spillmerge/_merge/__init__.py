"""The merge: the plan, the copy, the output's documents and index, parts and leases."""
