/* slurmstepd (remote context) and slurmd. Only logging and environment: nothing is
 * executed here (slurmd and slurmstepd run as root). The messages go to the slurmd log. */
#include <stdint.h>
#include <stdio.h>
#include <sys/wait.h>

#include <slurm/slurm.h>

#include "tm_spank.h"

static void step_name(spank_t sp, uint32_t *job, char *buf, size_t len)
{
    uint32_t step = 0;
    *job = 0;
    spank_get_item(sp, S_JOB_ID, job);
    if (spank_get_item(sp, S_JOB_STEPID, &step) != ESPANK_SUCCESS)
        snprintf(buf, len, "?");
    else if (step == SLURM_BATCH_SCRIPT)
        snprintf(buf, len, "batch");
    else if (step == SLURM_EXTERN_CONT)
        snprintf(buf, len, "extern");
    else if (step == SLURM_INTERACTIVE_STEP)
        snprintf(buf, len, "interactive");
    else
        snprintf(buf, len, "%u", step);
}

int tm_remote_user_init(spank_t sp, const struct tm_opts *o)
{
    uint32_t job;
    char step[16], buf[16];
    const char *num = tm_standbys_value(o, buf, sizeof(buf));
    step_name(sp, &job, step, sizeof(step));
    if (num)  /* Keep what sbatch/srun exported; fill in only what is missing. */
        spank_setenv(sp, "TM_STANDBYS", num, 0);
    if (o->reservation[0])
        spank_setenv(sp, "TM_RESERVATION", o->reservation, 0);
    slurm_info(TM_PREFIX "job %u step %s runs under TrainMover (standbys=%s, reservation=%s)", job, step,
               num ? num : "default", o->reservation[0] ? o->reservation : "default");
    return 0;
}

int tm_remote_task_exit(spank_t sp, const struct tm_opts *o)
{
    uint32_t job, task = 0;
    int status = 0;
    char step[16];
    (void)o;
    step_name(sp, &job, step, sizeof(step));
    spank_get_item(sp, S_TASK_GLOBAL_ID, &task);
    if (spank_get_item(sp, S_TASK_EXIT_STATUS, &status) != ESPANK_SUCCESS)
        slurm_info(TM_PREFIX "job %u step %s task %u exited (status unknown)", job, step, task);
    else if (WIFSIGNALED(status))
        slurm_info(TM_PREFIX "job %u step %s task %u killed by signal %d", job, step, task, WTERMSIG(status));
    else
        slurm_info(TM_PREFIX "job %u step %s task %u exited with status %d", job, step, task,
                   WEXITSTATUS(status));
    return 0;
}

int tm_remote_exit(spank_t sp, const struct tm_opts *o)
{
    uint32_t job;
    char step[16];
    (void)o;
    step_name(sp, &job, step, sizeof(step));
    slurm_info(TM_PREFIX "job %u step %s ends", job, step);
    return 0;
}

int tm_slurmd_init(spank_t sp)
{
    (void)sp;
    slurm_info(TM_PREFIX "plugin loaded in slurmd (built against Slurm %d.%02d)", SLURM_VERSION_MAJOR(SLURM_VERSION_NUMBER), SLURM_VERSION_MINOR(SLURM_VERSION_NUMBER));
    return 0;
}
