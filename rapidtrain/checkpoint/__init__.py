"""Checkpoints: the save/load format (DCP, manifest, lock, safe unpickling, async save), the save folder's safety, and
the reader that loads any layout whole for generate and convert."""
