"""The cost model, pure functions of a config, an operator list, a device Profile and a layout:
parameters, FLOPs, memory, communication and step time. Nothing here times, allocates or builds a model."""
