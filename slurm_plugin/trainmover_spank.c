/* TrainMover SPANK plugin: the slurm_spank_* entry points and the one dispatch on
 * spank_context(). Each context's work lives in its own file (tm_allocator.c for
 * sbatch/salloc/srun, tm_remote.c for slurmstepd and slurmd).
 *
 * Adds --trainmover[=standbys=N,reservation=NAME] to sbatch, salloc and srun. The value
 * is checked at submit time (a bad one fails the command); the settings reach the job as
 * TM_STANDBYS / TM_RESERVATION, which `trainmover controller` reads. The plugin never runs
 * Python or any other program: in slurmd/slurmstepd it only logs and sets environment
 * variables, so no user-controlled code runs as root.
 */
#include <stdio.h>
#include <string.h>

#include "tm_spank.h"

SPANK_PLUGIN(trainmover, 1);

enum tm_hook { TM_INIT, TM_INIT_POST_OPT, TM_USER_INIT, TM_TASK_EXIT, TM_EXIT };

static struct tm_opts g_opts = { .given = 0, .standbys = -1, .reservation = "" };

static int opt_cb(int val, const char *optarg, int remote)
{
    char err[256];
    (void)val;
    (void)remote;
    if (tm_opts_parse(optarg, &g_opts, err, sizeof(err)) != 0) {
        slurm_error(TM_PREFIX "%s", err);
        return -1;
    }
    return 0;
}

static struct spank_option tm_option = {
    .name = TM_NAME,
    .arginfo = "OPTS",
    .usage = "Run the job under TrainMover live migration. OPTS (optional, comma "
             "separated): standbys=N (warm standby nodes, 0-64, or auto: picked from the job's size and the site's failure rates), reservation=NAME "
             "(reservation holding the standby nodes).",
    .has_arg = 2, /* optional argument: --trainmover or --trainmover=OPTS */
    .val = 0,
    .cb = opt_cb,
};

static int register_option(spank_t sp)
{
    /* Slurm 22.05 ignores a static spank_options table in sbatch/salloc (allocator
     * context): register explicitly in every context that parses options. */
    spank_err_t rc = spank_option_register(sp, &tm_option);
    if (rc != ESPANK_SUCCESS) {
        slurm_error(TM_PREFIX "cannot register --%s: %s", TM_NAME, spank_strerror(rc));
        return -1;
    }
    return 0;
}

static int dispatch(enum tm_hook hook, spank_t sp)
{
    spank_context_t ctx = spank_context();
    switch (ctx) {
    case S_CTX_ALLOCATOR:
    case S_CTX_LOCAL:
        if (hook == TM_INIT)
            return register_option(sp);
        if (hook == TM_INIT_POST_OPT && g_opts.given)
            return tm_allocator_post_opt(sp, &g_opts);
        return 0;
    case S_CTX_REMOTE:
        if (hook == TM_INIT)
            return register_option(sp);
        if (!g_opts.given)
            return 0;
        if (hook == TM_USER_INIT)
            return tm_remote_user_init(sp, &g_opts);
        if (hook == TM_TASK_EXIT)
            return tm_remote_task_exit(sp, &g_opts);
        if (hook == TM_EXIT)
            return tm_remote_exit(sp, &g_opts);
        return 0;
    case S_CTX_SLURMD:
        return hook == TM_INIT ? tm_slurmd_init(sp) : 0;
    case S_CTX_JOB_SCRIPT:
        return 0;
    case S_CTX_ERROR:
    default:
        slurm_error(TM_PREFIX "unknown SPANK context %d", (int)ctx);
        return -1;
    }
}

int slurm_spank_init(spank_t sp, int ac, char **av)
{
    (void)ac;
    (void)av;
    return dispatch(TM_INIT, sp);
}

int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
    (void)ac;
    (void)av;
    return dispatch(TM_INIT_POST_OPT, sp);
}

int slurm_spank_user_init(spank_t sp, int ac, char **av)
{
    (void)ac;
    (void)av;
    return dispatch(TM_USER_INIT, sp);
}

int slurm_spank_task_exit(spank_t sp, int ac, char **av)
{
    (void)ac;
    (void)av;
    return dispatch(TM_TASK_EXIT, sp);
}

int slurm_spank_exit(spank_t sp, int ac, char **av)
{
    (void)ac;
    (void)av;
    return dispatch(TM_EXIT, sp);
}
