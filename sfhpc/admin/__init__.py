"""Admin commands: show a cluster tag map, check it against the live cluster."""
