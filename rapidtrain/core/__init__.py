"""The foundation: errors, the log line and MFU, shutdown, peak FLOPs, the CPU allocator, Slurm. Knows nothing of
the rest of rapidtrain."""
