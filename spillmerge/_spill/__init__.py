"""Reading a spill root: the commit barrier, segments, removal after a merge."""
