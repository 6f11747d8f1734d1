"""The controller's decisions, pure: events and the time in, actions out (no I/O, no Slurm,
no clock). `core.Policy` is the one entry point; planned migrations (`planner`), unexpected
failures (`recovery`, `tiers`), a successor's takeover (`takeover`), a lost standby
(`standby_loss`), the standby pool, stragglers, silence (`liveness`) and progress are its parts."""
