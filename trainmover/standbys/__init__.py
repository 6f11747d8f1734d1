"""How many warm standbys a job should keep (`trainmover plan`, `TM_STANDBYS=auto`).

`model` solves the simulator's event model in closed form (pure arithmetic); `site` holds the
site's rates (the admin's site.toml or the published ones); `history` measures rates from the
jobs' journals or sacct; `auto` is the controller's pure choice; `cli` prints the plan.
See docs/simulator.md.
"""
