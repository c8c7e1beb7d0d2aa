"""One module per CLI command: parse the arguments, call the library, print. trainwise.cli dispatches
to them."""
