"""The corpus, from files on disk to batches of token windows: sources (which files, how they are
read), formats (text pieces), tokencache (tokens on disk), corpus (tokenizer and token data),
batches (samplers), bpb (bytes behind tokens), report (`trainwise data`)."""
