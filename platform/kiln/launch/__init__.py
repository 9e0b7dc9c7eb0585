"""The drivers: one preflight every launcher calls, then the run on Ray Train or in-process."""
