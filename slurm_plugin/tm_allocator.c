/* sbatch/salloc (allocator context) and srun (local context): the option was already
 * validated by its callback; hand the settings to the job as TM_* variables, which
 * `trainmover controller` reads (trainmover/config.py).
 *
 * spank_setenv() answers "Valid only in remote context" here (22.05), so the variables go
 * into this process's environment, which sbatch/salloc/srun copy into the job (the default
 * --export=ALL). With --export=NONE the remote context fills them in (tm_remote.c). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tm_spank.h"

static int set(const char *var, const char *val)
{
    /* The command line wins over a value already in the environment. */
    if (setenv(var, val, 1) != 0) {
        slurm_error(TM_PREFIX "cannot set %s=%s: %s", var, val, strerror(errno));
        return -1;
    }
    return 0;
}

int tm_allocator_post_opt(spank_t sp, const struct tm_opts *o)
{
    (void)sp;
    char buf[16];
    const char *num = tm_standbys_value(o, buf, sizeof(buf));
    if (num && set("TM_STANDBYS", num) != 0)
        return -1;
    if (o->reservation[0] && set("TM_RESERVATION", o->reservation) != 0)
        return -1;
    slurm_verbose(TM_PREFIX "job will run under TrainMover (standbys=%s, reservation=%s)",
                  num ? num : "default", o->reservation[0] ? o->reservation : "default");
    return 0;
}
