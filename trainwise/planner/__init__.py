"""The planner's orchestration: resolve the hardware (one place), record the step's operators and time
the kernels this device lacks (measure), price them (cost), the Plan and its JSON, `--fit`, `--explain`."""
