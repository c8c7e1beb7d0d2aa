"""What devices can do, as data: the accelerator table, the step-time model's device Profile, the
calibration files measured on this machine, and the memory free now. Nothing here times anything."""
