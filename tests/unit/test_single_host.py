"""The one-host allocation of the GPU benchmarks: GPUs as nodes, CPU shares of whole cores."""
import pytest

from trainmover.slurm.single_host import SingleHostAllocation, cpu_share, physical_cores


def test_cpu_shares_keep_hyperthread_siblings_together():
    cores = [[0, 16], [1, 17], [2, 18], [3, 19]]  # siblings i and i+16, as many 2-socket hosts number them
    assert cpu_share(cores, 2, 0) == [0, 1, 16, 17] and cpu_share(cores, 2, 1) == [2, 3, 18, 19]
    assert cpu_share(cores, 8, 0) == []  # fewer cores than GPUs: no pinning


def test_physical_cores_from_the_topology(tmp_path):
    for cpu, (package, core) in {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1)}.items():
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(f"{package}\n")
        (d / "core_id").write_text(f"{core}\n")
    assert physical_cores([0, 1, 2, 3], str(tmp_path)) == [[0, 2], [1, 3]]
    assert physical_cores([0, 5], str(tmp_path)) == [[0], [5]]  # no topology for cpu5: its own core


def test_a_reference_job_alone_on_the_second_gpu(tmp_path):
    alloc = SingleHostAllocation(gpus=1, train=1, work_dir=str(tmp_path), first_gpu=1, host_gpus=2)
    assert alloc.job(1).nodes == ("gpu1",) and alloc.job(1).batch_host == "gpu1"
    argv = alloc.step_argv(1, "gpu1", ["python", "-m", "w"])
    assert "CUDA_VISIBLE_DEVICES=1" in argv and argv[-3:] == ["python", "-m", "w"]
    with pytest.raises(ValueError, match="not on a host of 2"):
        SingleHostAllocation(gpus=2, train=1, work_dir=str(tmp_path), first_gpu=1, host_gpus=2)


def test_a_shared_gpu_runs_every_node_on_the_one_physical_gpu(tmp_path):
    from trainmover.slurm.single_host import SingleHostAllocation
    alloc = SingleHostAllocation(gpus=2, train=1, work_dir=str(tmp_path), share_gpu=True)
    assert alloc.host_gpus == 1
    for node in ("gpu0", "gpu1"):
        argv = alloc.step_argv(1, node, ["python", "-m", "x"])
        assert "CUDA_VISIBLE_DEVICES=0" in argv and f"SLURMD_NODENAME={node}" in argv
    apart = SingleHostAllocation(gpus=2, train=1, work_dir=str(tmp_path))
    assert "CUDA_VISIBLE_DEVICES=1" in apart.step_argv(1, "gpu1", ["python"])


def test_the_single_host_allocation_keeps_the_slurm_client_contract(tmp_path):
    """The SlurmClient protocol, as tests/e2e/test_slurm_contract.py holds the Slurm backends
    to it: grow takes a free node into the job, shrink gives back all but what is kept (never
    the batch host), drain and resume show in the node's state, none left is NoStandbyAvailable."""
    from trainmover.slurm.client import SlurmClient
    from trainmover.slurm.model import BatchHostRelease, NoStandbyAvailable
    alloc = SingleHostAllocation(gpus=3, train=1, work_dir=str(tmp_path))
    assert isinstance(alloc, SlurmClient)
    assert alloc.hostnames("gpu0,gpu2") == ["gpu0", "gpu2"] and alloc.hostnames("") == []
    assert alloc.reservation_nodes("r") == alloc.free_standbys("r") == ["gpu1", "gpu2"]
    new = alloc.grow(1, reservation="r")
    assert new == "gpu1" and alloc.job(1).nodes == ("gpu0", "gpu1") and alloc.job(1).num_nodes == 2
    assert alloc.nodes([new])[new].state.startswith("ALLOCATED") and alloc.free_standbys("r") == ["gpu2"]
    alloc.drain("gpu2", "test")
    assert "DRAIN" in alloc.nodes(["gpu2"])["gpu2"].state and alloc.free_standbys("r") == []
    with pytest.raises(NoStandbyAvailable):
        alloc.grow(1, reservation="r")
    alloc.resume("gpu2")
    assert "DRAIN" not in alloc.nodes(["gpu2"])["gpu2"].state and alloc.free_standbys("r") == ["gpu2"]
    with pytest.raises(BatchHostRelease):
        alloc.shrink(1, ["gpu1"])
    assert alloc.shrink(1, ["gpu0"]) == ["gpu1"] and alloc.job(1).nodes == ("gpu0",)
    assert alloc.kill_steps(1, "gpu1") == [] and alloc.cancel_donors(1) == []
    caps = alloc.capabilities(1, "r")
    assert caps.grow and caps.shrink and caps.drain


def test_a_standby_gpu_puts_every_standby_beside_that_worker(tmp_path):
    """2 workers + 1 standby on a 2-GPU host (bench/gpu_planned_migration.py --standby-gpu 1):
    the workers keep their own GPUs, the standby runs on GPU 1; without the option, its own."""
    from trainmover.slurm.single_host import SingleHostAllocation

    def gpu(alloc, node):
        return next(a for a in alloc.step_argv(1, node, ["x"]) if a.startswith("CUDA_VISIBLE_DEVICES="))

    beside = SingleHostAllocation(gpus=3, train=2, work_dir=str(tmp_path), host_gpus=3, standby_gpu=1)
    assert [gpu(beside, n) for n in ("gpu0", "gpu1", "gpu2")] == [f"CUDA_VISIBLE_DEVICES={i}" for i in (0, 1, 1)]
    own = SingleHostAllocation(gpus=3, train=2, work_dir=str(tmp_path))
    assert gpu(own, "gpu2") == "CUDA_VISIBLE_DEVICES=2"
