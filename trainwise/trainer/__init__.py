"""The training loop and what it needs around it: relaunch = resume, the memory check, what a run
reports about itself, where its metrics go."""
