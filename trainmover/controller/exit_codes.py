"""The controller process's exit codes, in one place: its supervisor (controller/succession/supervisor.py)
decides on them whether to start another controller, and the keeper (controller/succession/keeper.py,
controller/succession/rules.py) whether to move the controller to another node."""

FINISHED = 0    # training finished
FAILED = 1      # the job stopped with an error the controller reported
REFUSED = 2     # a configuration or journal error: it would fail the same anywhere, never restarted
MOVED = 3       # its node leaves the job: the keeper resumes the controller elsewhere
SUPERSEDED = 4  # demoted: a successor claimed the journal (controller/durable/journal.py); not an end of the job
CRASHED = 70    # an unexpected exception (EX_SOFTWARE): the supervisor restarts the controller
