"""How one training step runs, built in one place (step.py): precision, optimizer, activation
checkpointing and compile applied from outside the model, DDP/FSDP2 sharding, checkpoint files, the
host allocator."""
