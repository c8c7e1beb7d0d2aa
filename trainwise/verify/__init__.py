"""The planner held to what runs: verify.json (one real step measured against the plan), per-rank
checks under torchrun, the roofline with `--measure`, and `plan --simulate` on fake tensors."""
