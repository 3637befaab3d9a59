"""Subcommands of `pdserve` (see pdserve.cli)."""
