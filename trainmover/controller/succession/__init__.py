"""Who runs the job's controller: the keeper (the batch script's process on the keeper node,
which runs every step and promotes a successor), the supervisor (the batch step's process on a
job without a keeper node: restarts the controller from its journal) and the rules both follow
(`rules`, pure)."""
