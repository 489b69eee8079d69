"""One module per subcommand. Each defines `register(subparsers)` that adds its parser and sets
`func=run(args) -> int`. The modules compose the packages; they hold no logic of their own."""
