/* TrainMover SPANK plugin: shared declarations.
 *
 * trainmover_spank.c  the slurm_spank_* entry points and the one dispatch on spank_context()
 * tm_options.c        parsing of --trainmover[=OPTS] (pure: no Slurm calls, unit-tested)
 * tm_allocator.c      sbatch/salloc/srun (allocator and local contexts)
 * tm_remote.c         slurmstepd (remote context) and slurmd
 */
#ifndef TM_SPANK_H
#define TM_SPANK_H

#include <stddef.h>

#define TM_NAME "trainmover"
#define TM_MAX_STANDBYS 64
#define TM_MAX_NAME 64

/* Every message of the plugin starts with "trainmover: ". */
#define TM_PREFIX TM_NAME ": "

struct tm_opts {
    int given;                      /* --trainmover was on the command line */
    int standbys;                   /* -1: not given (the controller's default); TM_STANDBYS_AUTO: auto */
    char reservation[TM_MAX_NAME];  /* "": not given */
};

#define TM_STANDBYS_AUTO (-2)       /* standbys=auto: the controller picks (TM_STANDBYS=auto) */

void tm_opts_reset(struct tm_opts *o);
/* The value TM_STANDBYS gets ("auto" or the number), or NULL when standbys was not given. */
const char *tm_standbys_value(const struct tm_opts *o, char *buf, size_t len);
/* Parse OPTS ("standbys=N|auto,reservation=NAME"; NULL or "" means defaults) into *o.
 * Returns 0, or -1 with a message (without prefix) in err. */
int tm_opts_parse(const char *arg, struct tm_opts *o, char *err, size_t errlen);

#ifdef TM_WITH_SLURM
#include <slurm/spank.h>
int tm_allocator_post_opt(spank_t sp, const struct tm_opts *o);
int tm_remote_user_init(spank_t sp, const struct tm_opts *o);
int tm_remote_task_exit(spank_t sp, const struct tm_opts *o);
int tm_remote_exit(spank_t sp, const struct tm_opts *o);
int tm_slurmd_init(spank_t sp);
#endif

#endif
