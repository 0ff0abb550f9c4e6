"""Optimizers by diffusion-pipe's names, and the two PipeTrain writes itself (Automagic, AdamW8bitKahan)."""
