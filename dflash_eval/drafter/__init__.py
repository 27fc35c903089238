"""The DFlash drafter: the model (DFlash 1 and 2), its config, checkpoint formats, stripping, and the demo trainer."""
