"""Layers and losses, one family per file, each array function beside its hand rule."""
