"""Instruments: the FLOP counter, the memory tracker, the operator recorder (fake tensors), kernel and
reference-step timing, and the calibration of this machine."""
