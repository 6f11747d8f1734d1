/*
 * tm_nodes: the state of some nodes from ONE slurmctld RPC.
 *
 *   tm_nodes NODE...      one `scontrol -o show node` line per named node (all without names)
 *
 * `scontrol show node` costs slurmctld two RPCs (REQUEST_NODE_INFO, then
 * REQUEST_PARTITION_INFO to fill in each node's Partitions=), and a job's controller asks
 * every few seconds: under SlurmctldParameters=rl_enable every RPC spends a token of the
 * job's user. This asks for the node table alone and prints it in scontrol's own words
 * (slurm_sprint_node_table, one line a node), so trainmover/slurm/parse.py reads either.
 * Built with the SPANK plugin, against the same release's libslurm (docs/admin.md).
 *
 * Exit 0: every named node printed; 1: slurmctld could not be asked (message on stderr);
 * 2: some named node is unknown ("Node X not found" on stdout, as scontrol says it).
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <slurm/slurm.h>
#include <slurm/slurm_errno.h>

#define PREFIX "tm_nodes: "

int main(int argc, char **argv)
{
	node_info_msg_t *msg = NULL;
	int missing = 0;

	slurm_init(NULL);
	/* SHOW_ALL: nodes of hidden partitions too, as scontrol -a; SHOW_MIXED: the MIXED state. */
	if (slurm_load_node((time_t) 0, &msg, SHOW_ALL | SHOW_MIXED) != SLURM_SUCCESS) {
		/* libslurm sets errno (slurm_get_errno() is gone in 24.11) */
		fprintf(stderr, PREFIX "slurm_load_node: %s\n", slurm_strerror(errno));
		return 1;
	}
	for (int a = (argc > 1 ? 1 : 0); a < argc; a++) {
		int found = 0;

		for (uint32_t i = 0; i < msg->record_count; i++) {
			node_info_t *node = &msg->node_array[i];

			if (!node->name || (argc > 1 && strcmp(node->name, argv[a])))
				continue;
			/* scontrol's one-liner, newline included; freed at exit (one short run) */
			fputs(slurm_sprint_node_table(node, 1), stdout);
			found = 1;
			if (argc > 1)
				break;
		}
		if (argc > 1 && !found) {
			printf("Node %s not found\n", argv[a]);
			missing = 1;
		}
	}
	slurm_free_node_info_msg(msg);
	slurm_fini();
	return missing ? 2 : 0;
}
