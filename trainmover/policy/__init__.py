"""Pure decision policies fed with measurements (no clock, no I/O): straggler detection."""
