"""The HDF5 hidden-state cache: its format, the target forward that writes it, resumable writer, verified reader, shards."""
