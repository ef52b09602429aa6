"""Model definitions, their configs and the checkpoint loader."""
