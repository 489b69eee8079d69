"""phaselens: the `phaselens` command. Subcommands live in `phaselens.commands`, one module each."""
