"""PyTorch Lightning under TrainMover: one callback, the Trainer and its loop kept.

    from trainmover.integrations.lightning import TrainMoverCallback
    trainer = L.Trainer(..., strategy="ddp", callbacks=[TrainMoverCallback()])

Run the script with `trainmover run` (script mode, trainmover/script). The world is the job's:
script mode makes it torch's default group and sets RANK, GROUP_RANK, LOCAL_RANK,
LOCAL_WORLD_SIZE, WORLD_SIZE, so Lightning picks its TorchElasticEnvironment (ahead of SLURM's)
and its DDP strategy finds the group initialised and uses it. Under plain torchrun the
callback does nothing.

The step boundary (owner.py) is the end of a training batch that ended with an optimizer step
(accumulate_grad_batches respected): after its hooks, its logging and any validation it
triggered, i.e. after the epoch loop's `on_advance_end`, where nothing of the step is left.

The state there is Lightning's own checkpoint (`dump_checkpoint()`: model, optimizers, LR
schedulers, loops' progress, callbacks, precision plugin, datamodule) plus the data position
(the random state when the epoch's loader iterator was made, the batches fetched), the latest
batch (for warm iterations), the loggers' unsaved rows and the random state. A rank taking
over re-enters through Lightning's resume path: its fresh `fit` restores from that dict in
memory (the checkpoint connector's `resume_start` hands it over instead of reading a file),
and at the start of its epoch loop the loader's iterator is made again and moved to the
position (Lightning itself restarts a plain DataLoader from its first batch), warm iterations
run on the latest batch in the sandbox (DDP rebuilds its buckets; they are undone), and the
loops' restart flags are cleared, so the loop goes on as the leaver's would have.

Side effects: loggers and checkpoint files act only while the run is live (not on a standby,
not during a re-entry, not on a rank being abandoned); a CSVLogger of a rank taking over keeps
its version directory and appends to its metrics.csv instead of starting a new one.
"""
from __future__ import annotations

import copy
import functools
import io
import logging
import os
import warnings
from collections import OrderedDict

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.trainer import call

from trainmover.errors import ConfigError
from trainmover.groups import rng
from trainmover.script import owner as tm_owner
from trainmover.script.loops import generators_of, skip
from trainmover.script.run import EndRun, current

log = logging.getLogger("trainmover.lightning")

NAME = "lightning"
# Checkpoint keys a fresh run does not need (its model is built already) and that may hold
# objects the transfer's weights-only decoding refuses (an AttributeDict, a Namespace).
_HPARAM_KEYS = ("hyper_parameters", "hparams_name", "hparams_type", "datamodule_hyper_parameters",
                "datamodule_hparams_name", "datamodule_hparams_type")
_PACKED = "__trainmover_packed__"
_LOGGER_EFFECTS = ("log_metrics", "log_hyperparams", "log_graph", "save", "finalize", "after_save_checkpoint")


def pack(obj):
    """Lightning's checkpoint (bar model and optimizers) as the transfer carries it: as it is,
    except float tensors holding inf or NaN (a ModelCheckpoint's kth_value, an EarlyStopping's
    best_score start at inf), which the transfer refuses: those go as their torch.save bytes."""
    if isinstance(obj, dict):
        return {k: pack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(pack(v) for v in obj)
    if isinstance(obj, torch.Tensor) and obj.is_floating_point() and not bool(torch.isfinite(obj).all()):
        buf = io.BytesIO()
        torch.save(obj.detach().cpu(), buf)
        return {_PACKED: torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)}
    return obj


def unpack(obj):
    if isinstance(obj, dict):
        if set(obj) == {_PACKED}:
            return torch.load(io.BytesIO(obj[_PACKED].numpy().tobytes()), weights_only=True)
        return {k: unpack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(unpack(v) for v in obj)
    return obj


def _plain(batch):
    """A batch as the transfer carries it (tuples become lists; training_step unpacks both)."""
    if isinstance(batch, (list, tuple)):
        return [_plain(b) for b in batch]
    if isinstance(batch, dict):
        return {k: _plain(v) for k, v in batch.items()}
    return batch


def _record_iterator_creation() -> None:
    """Record the random state each DataLoader iterator is made with (its shuffle seed and its
    workers' base seed are drawn then), on the loader: Lightning makes the epoch's iterator
    inside its loops, where no hook reaches. Only records; only inside a TrainMover run."""
    from torch.utils.data import DataLoader
    if getattr(DataLoader._get_iterator, "_trainmover", False):
        return
    original = DataLoader._get_iterator

    def _get_iterator(self):
        if current() is not None:
            self.__dict__["_tm_created"] = (rng.capture(), [g.get_state() for g in generators_of(self)])
        return original(self)

    _get_iterator._trainmover = True
    DataLoader._get_iterator = _get_iterator


def _quiet_csv_writer() -> None:
    """A CSVLogger's writer made while the run is not live (Lightning makes it on rank 0 before
    any callback hook) leaves the file system alone: Lightning's deletes an existing metrics.csv,
    which on a standby or a re-entry is the live job's, and makes the directory, which on a standby
    is a new empty version_N (the next free one) left beside the job's."""
    from lightning.fabric.loggers.csv_logs import _ExperimentWriter
    if getattr(_ExperimentWriter._check_log_dir_exists, "_trainmover", False):
        return
    check = _ExperimentWriter._check_log_dir_exists

    def _check_log_dir_exists(self):
        if tm_owner.live():
            check(self)
        else:  # and its makedirs after this makes the directory that the live rank makes anyway
            log.debug("CSV writer for %s made while not live: %s left as it is", self.log_dir, self.NAME_METRICS_FILE)

    _check_log_dir_exists._trainmover = True
    _ExperimentWriter._check_log_dir_exists = _check_log_dir_exists
    init = _ExperimentWriter.__init__

    def __init__(self, log_dir: str) -> None:
        if tm_owner.live():
            return init(self, log_dir)
        existed = os.path.isdir(log_dir)
        init(self, log_dir)
        if not existed:  # made off-live (a standby's next free version_N): not left behind, empty
            try:
                os.rmdir(log_dir)  # the live rank makes its directory at its first log (_logger_effect)
            except OSError:
                pass

    _ExperimentWriter.__init__ = __init__


def _settle_version(lg, version) -> None:
    """Fixes a logger's version to the run's. Lightning makes every logger's writer before the
    first callback hook (its setup hook), after its profiler asked for the directory: on a rank
    re-entering, or on a standby, that took the next free version (a new, empty version_N), and
    setting the version afterwards left the writer there: a re-entered rank 0 went on logging
    into version_N. A CSV writer made for another version is pointed at this version's directory
    (not made again: made live, Lightning's writer deletes the metrics.csv it finds there), and
    the directory it made is removed if still empty."""
    lg._version = version
    writer = getattr(lg, "_experiment", None)
    if writer is None or not hasattr(writer, "metrics_keys") or writer.log_dir == lg.log_dir:
        return  # none made yet, not a CSV writer (TensorBoard's holds files open), or the right one
    stray, writer.log_dir = writer.log_dir, lg.log_dir
    writer.metrics_file_path = os.path.join(writer.log_dir, writer.NAME_METRICS_FILE)
    try:
        os.rmdir(stray)  # only an empty directory: one that holds a file is someone's
    except OSError:
        pass


class TrainMoverCallback(Callback):
    """Makes `Trainer.fit` migratable under TrainMover (module docstring); nothing otherwise."""

    name = NAME

    def __init__(self):
        self.trainer = None
        self.reentry: dict | None = None  # the checkpoint and positions to re-enter at, until done
        self.loggers: list[dict] = []     # per logger: a re-entry's version, unsaved rows and rows on disk
        self.rows: dict[int, int] = {}    # rows each CSV logger has saved (its metrics.csv's data rows)
        self.adopted: set[int] = set()
        self.abandoned = False
        self.batch = self.loss = None
        self.files: list[str] = []        # checkpoint files this job's run has saved (rank 0)

    # -- Lightning's hooks --
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit" or current() is None:
            return
        self.trainer = trainer
        state = tm_owner.attach(self)
        self._guard_effects(trainer)
        self._hook_loops(trainer)
        if state is None:
            # One version directory on every rank (rank 0's: Lightning broadcasts paths built
            # from it), carried in the state so that a rank taking over keeps it.
            for lg in trainer.loggers:
                if hasattr(lg, "_version"):
                    _settle_version(lg, trainer.strategy.broadcast(lg.version))
            return
        extra = unpack(state[NAME])
        ckpt = dict(extra["checkpoint"], state_dict=state["model"]["lightning_module"])
        if "optimizer" in state:
            ckpt["optimizer_states"] = [state["optimizer"][f"lightning_optimizer_{i}"]
                                        for i in range(extra["optimizers"])]
        else:  # the runtime's negative control (TM_INJECT=skip-optimizer-state): keep our own
            log.warning("the state carries no optimizer: the Trainer's optimizers keep their own state")
        self.reentry = {**extra, "checkpoint": ckpt}
        self.loggers = extra["loggers"]
        self.batch = extra["batch"]  # the state stands where it was taken, latest batch included
        self.files = list(extra["files"])
        for lg, saved in zip(trainer.loggers, self.loggers):
            if saved.get("version") is not None and hasattr(lg, "_version"):
                _settle_version(lg, saved["version"])  # before ModelCheckpoint.setup reads it: the same directory
        connector = trainer._checkpoint_connector

        def resume_start(checkpoint_path=None):  # Lightning's resume path, from memory
            if "optimizer_states" not in ckpt:
                ckpt["optimizer_states"] = [trainer.strategy.optimizer_state(o) for o in trainer.optimizers]
            connector._ckpt_path = "trainmover:live-state"
            connector._loaded_checkpoint = ckpt

        connector.resume_start = resume_start

    def on_train_start(self, trainer, pl_module) -> None:
        tm_owner.entry()  # a fresh start: set-up done (build ends here)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batch = batch
        self.loss = outputs.get("loss") if isinstance(outputs, dict) else outputs

    def on_exception(self, trainer, pl_module, exception) -> None:
        if isinstance(exception, EndRun):  # this run is abandoned: its loggers must not flush now
            self.abandoned = True

    # -- the owner's side (script/owner.py) --
    def state(self) -> dict:
        trainer = self.trainer
        ckpt = trainer._checkpoint_connector.dump_checkpoint()
        model = ckpt.pop("state_dict")
        optimizers = ckpt.pop("optimizer_states", [])
        for key in _HPARAM_KEYS:
            ckpt.pop(key, None)
        extra = {"checkpoint": ckpt, "optimizers": len(optimizers), "data": self._data_position(),
                 "batch": _plain(self.batch), "loggers": self._logger_states(), "files": list(self.files), "rng": rng.capture()}
        return {"model": {"lightning_module": model},
                "optimizer": {f"lightning_optimizer_{i}": o for i, o in enumerate(optimizers)},
                NAME: pack(extra)}

    def _data_position(self) -> dict:
        fetcher = self.trainer.fit_loop._data_fetcher
        if fetcher is None:  # fit has ended (the state is taken for the job's final digest): no position
            return {"created": [], "gens": [], "fetched": 0, "done": True}
        if getattr(fetcher, "batches", None):
            raise ConfigError("the training loader has no length (an IterableDataset): Lightning prefetches from it and "
                              "TrainMover cannot put a rank taking over at the same batch; give the dataset a __len__")
        loaders = fetcher.combined_loader.flattened
        missing = [i for i, dl in enumerate(loaders) if "_tm_created" not in getattr(dl, "__dict__", {})]
        if missing:
            raise ConfigError(f"training loaders {missing} are not torch DataLoaders made under TrainMover: their "
                              "position cannot be carried")
        return {"created": [dl._tm_created[0] for dl in loaders], "gens": [dl._tm_created[1] for dl in loaders],
                "fetched": fetcher.fetched, "done": fetcher.done}

    def _logger_states(self) -> list[dict]:
        out = []
        for i, lg in enumerate(self.trainer.loggers):
            if i not in self.adopted and i < len(self.loggers):  # a re-entered run that has not logged yet
                out.append(copy.deepcopy(self.loggers[i]))
                continue
            writer = getattr(lg, "_experiment", None)
            saved = {"version": getattr(lg, "_version", None)}
            if hasattr(writer, "metrics_keys"):  # a CSVLogger's writer, on the rank that writes (rank 0)
                saved.update(metrics=copy.deepcopy(writer.metrics), keys=list(writer.metrics_keys),
                             rows=self.rows.get(i, 0))
            out.append(saved)
        return out

    def _boundary(self) -> None:
        tm_owner.boundary(self.loss)

    # -- re-entry --
    def _reenter(self, fetcher) -> None:
        """At the start of the re-entered epoch loop (after Lightning restored everything and
        its own restart bookkeeping): the data where it was, warm iterations, then live."""
        re, trainer = self.reentry, self.trainer
        self._position(fetcher, re["data"])
        if re["batch"] is not None:
            self._warm(re)
        fit_loop = trainer.fit_loop
        _Loop.restarting.fset(fit_loop, False)  # and every loop inside: no restart-stage shortcuts from here on
        for loop in (fit_loop, fit_loop.epoch_loop, fit_loop.epoch_loop.val_loop):
            loop._resuming_from_checkpoint = loop._loaded_from_state_dict = False
        rng.restore(re["rng"])
        self.reentry = None
        tm_owner.reentered()

    def _position(self, fetcher, data: dict) -> None:
        """The epoch's loader iterator made again as the leaver made it, moved past the batches
        it had fetched (indices only for a single-process DataLoader: loops.skip)."""
        combined = fetcher.combined_loader
        rng.restore(data["created"][0])
        for dl, states in zip(combined.flattened, data["gens"]):
            for gen, st in zip(generators_of(dl), states):
                gen.set_state(st)
        fetcher.iterator = iter(combined)
        mode = combined._iterator
        n = int(data["fetched"])
        if len(mode.iterators) == 1:
            skip(mode.iterators[0], n)
            mode._idx += n
        else:
            for _ in range(n):
                next(mode)
        fetcher.fetched, fetcher.done = n, bool(data["done"])

    def _warm(self, re: dict) -> None:
        """Training steps on copies of the latest batch through the DDP-wrapped model (its
        first iterations' collectives happen here, in the sandbox), then their effects undone
        from the same checkpoint: model, optimizers, schedulers, precision, step counters."""
        trainer = self.trainer
        epoch_loop = trainer.fit_loop.epoch_loop
        progress = [epoch_loop.automatic_optimization.optim_progress, epoch_loop.manual_optimization.optim_step_progress]
        saved = [p.state_dict() for p in progress]
        batch_idx = max(epoch_loop.batch_idx, 0)
        while True:
            kwargs = epoch_loop._build_kwargs(OrderedDict(), copy.deepcopy(re["batch"]), batch_idx)
            out = call._call_strategy_hook(trainer, "training_step", *kwargs.values())
            loss = out.get("loss") if isinstance(out, dict) else out
            if trainer.lightning_module.automatic_optimization and isinstance(loss, torch.Tensor) and loss.requires_grad:
                loss.backward()
            for opt in trainer.optimizers:
                opt.zero_grad(set_to_none=True)
            if not tm_owner.warm():
                break
        ckpt = re["checkpoint"]
        trainer.strategy.load_model_state_dict(ckpt, strict=trainer.lightning_module.strict_loading)
        trainer.strategy.load_optimizer_state_dict(ckpt)
        for config, st in zip(trainer.lr_scheduler_configs, ckpt["lr_schedulers"]):
            config.scheduler.load_state_dict(st)
        trainer._checkpoint_connector._loaded_checkpoint = ckpt
        trainer._checkpoint_connector.restore_precision_plugin_state()
        trainer._checkpoint_connector._loaded_checkpoint = {}
        for p, st in zip(progress, saved):
            p.load_state_dict(st)
        epoch_loop._results.reset()  # what the warm steps logged

    # -- hooks into Lightning's objects --
    def _hook_loops(self, trainer) -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        on_advance_end, on_run_start = epoch_loop.on_advance_end, epoch_loop.on_run_start

        def advance_end(data_fetcher):
            on_advance_end(data_fetcher)
            if not epoch_loop._should_accumulate():  # this batch ended with an optimizer step
                self._boundary()

        def run_start(data_fetcher):
            on_run_start(data_fetcher)
            if self.reentry is not None:
                self._reenter(data_fetcher)

        epoch_loop.on_advance_end, epoch_loop.on_run_start = advance_end, run_start
        # Lightning warns that a plain DataLoader cannot resume mid-epoch: here it does (_position).
        warnings.filterwarnings("ignore", message=".*resuming from a checkpoint that ended before the epoch ended.*")

    def _live(self) -> bool:
        return tm_owner.live() and not self.abandoned

    def _guard_effects(self, trainer) -> None:
        """Loggers and checkpoint files act only while live (module docstring)."""
        for i, lg in enumerate(trainer.loggers):
            for name in _LOGGER_EFFECTS:
                if hasattr(lg, name):
                    setattr(lg, name, functools.partial(self._logger_effect, i, lg, getattr(lg, name), name))
        cio = trainer.strategy.checkpoint_io
        for name in ("save_checkpoint", "remove_checkpoint"):
            setattr(cio, name, functools.partial(self._file_effect, name, getattr(cio, name)))
        for cb in trainer.checkpoint_callbacks:
            if hasattr(cb, "file_exists"):
                cb.file_exists = self._checkpoint_exists

    def _file_effect(self, name: str, original, *args, **kwargs):
        if not self._live():
            return None
        path = str(args[1] if name == "save_checkpoint" else args[0])
        out = original(*args, **kwargs)
        self.files = sorted(set(self.files) | {path}) if name == "save_checkpoint" else [f for f in self.files if f != path]
        return out

    def _checkpoint_exists(self, filepath, trainer) -> bool:
        """ModelCheckpoint's "is this name taken" (it then adds -v1): answered from the files this
        job's run saved (carried in the state), not the file system, where a leaver, a rolled-back
        run or a process sharing the directory may have saved the same name. Rank 0 decides."""
        return trainer.strategy.broadcast(str(filepath) in self.files)

    def _logger_effect(self, i: int, lg, original, name: str, *args, **kwargs):
        if not self._live():
            return None
        if i not in self.adopted:
            self.adopted.add(i)
            self._adopt(i, lg)
        writer = getattr(lg, "_experiment", None)
        csv = hasattr(writer, "metrics_keys")
        if csv:  # made off-live, a CSV writer has no directory yet (_quiet_csv_writer); checked at
            # every effect, not once: a standby's writer may remove it while still empty
            writer._fs.makedirs(writer.log_dir, exist_ok=True)
        pending = len(writer.metrics) if name == "save" and csv else 0
        out = original(*args, **kwargs)
        self.rows[i] = self.rows.get(i, 0) + pending
        return out

    def _adopt(self, i: int, lg) -> None:
        """A rank taking over goes on with the leaver's CSV writer: its unsaved rows, its header,
        and metrics.csv cut back to the rows saved when the state was taken (a recovery from an
        older snapshot redoes the steps after it)."""
        saved = self.loggers[i] if i < len(self.loggers) else {}
        writer = getattr(lg, "_experiment", None)
        if "keys" not in saved or not hasattr(writer, "metrics_keys"):
            return
        writer.metrics, writer.metrics_keys = list(saved["metrics"]), list(saved["keys"])
        writer._fs.makedirs(writer.log_dir, exist_ok=True)
        if writer._fs.isfile(writer.metrics_file_path):
            with writer._fs.open(writer.metrics_file_path, "r") as f:
                lines = f.read().splitlines(keepends=True)
            if len(lines) > 1 + saved["rows"]:
                with writer._fs.open(writer.metrics_file_path, "w") as f:
                    f.writelines(lines[:1 + saved["rows"]])
        self.rows[i] = saved["rows"]


_record_iterator_creation()
_quiet_csv_writer()
