"""Shared by every layer: errors with a file, field and fix; file helpers; options from the config schema; devices, threads, progress, the job watchdog and the GPU pool."""
