"""Hugging Face `Trainer` under TrainMover: one callback, the Trainer and its loop kept.

    from trainmover.integrations.huggingface import TrainMoverCallback
    trainer = Trainer(model=model, args=args, ..., callbacks=[TrainMoverCallback()])

Run the script with `trainmover run` (script mode, trainmover/script). The world is the job's:
script mode makes it torch's default group and sets RANK, LOCAL_RANK, WORLD_SIZE, ..., so the
Trainer's accelerate state finds the group initialised and uses it (`ddp_backend="gloo"` on
the CPU). Under plain torchrun the callback does nothing.

The step boundary (owner.py) is the end of an optimizer step (`on_step_end`, once per
`gradient_accumulation_steps` batches) after the `_maybe_log_save_evaluate` that follows it
(its logging, evaluation, checkpoint), where nothing of the step is left; for the last step
of an epoch, after the epoch's end (`on_epoch_end` and its log/evaluate/save), so that a rank
taking over starts the next epoch and no epoch-end work is lost or done twice.

The state there is what `_save_checkpoint` writes, taken in memory: the model's state_dict,
the optimizer's, the LR scheduler's, the GradScaler's (if any), the `TrainerState` (global
step, epoch, log history, the stateful callbacks and `TrainerControl`) and the random state;
plus the Trainer's running loss sums (not in its checkpoint: the first logged loss after
HF's own resume covers fewer steps) and the latest batch (for warm iterations). A rank taking
over re-enters through the Trainer's resume path: its fresh `train()` is called with a
resume marker, and the Trainer's loaders (`_load_from_checkpoint`, `TrainerState.load_from_json`,
`_init_training_state`'s resume branch, `_load_optimizer_and_scheduler`, `_load_scaler`,
`_load_rng_state`) take the dicts instead of files: no disk. The Trainer then positions the
loader itself (epoch = global_step // steps per epoch, `skip_first_batches` over the batches
of the steps done in it; accelerate's seedable sampler gives the epoch's order), and where
it restores the random state (after fetching the first batches of the resumed epoch, or at
the start of an epoch) warm iterations run in the sandbox on the latest batch (DDP's first
iterations' collectives), are undone, and the run goes live.

Side effects: checkpoints (`_save_checkpoint`, `save_model`) and the callbacks' `on_log`
(printing, report_to integrations) act only while the run is live: not on a standby, not
during a re-entry, not on a rank being abandoned. The log history itself is state (carried).
"""
from __future__ import annotations

import copy
import functools
import json
import logging

from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import TrainerState

from trainmover.groups import rng
from trainmover.script import owner as tm_owner
from trainmover.script.run import EndRun, current

log = logging.getLogger("trainmover.huggingface")

NAME = "huggingface"
MARKER = "trainmover:live-state"  # the `resume_from_checkpoint` a re-entering run passes: no such directory
# The Trainer's running sums that its checkpoint leaves out (set in _inner_training_loop).
_COUNTERS = ("_total_loss_scalar", "_globalstep_last_logged", "current_flos", "_initial_global_step",
             "_initial_num_input_tokens_seen")


def _plain(batch):
    if isinstance(batch, (list, tuple)):
        return [_plain(b) for b in batch]
    if isinstance(batch, dict):
        return {k: _plain(v) for k, v in batch.items()}
    return batch


class TrainMoverCallback(TrainerCallback):
    """Makes `Trainer.train` migratable under TrainMover (module docstring); nothing otherwise."""

    name = NAME

    def __init__(self):
        self.trainer: Trainer | None = None
        self.reentry: dict | None = None  # the state to re-enter at, until the run is live
        self.pending = False              # an optimizer step ended; its boundary is still to come
        self.epoch_end = False
        self.loss = 0.0                   # this optimizer step's loss (the sum over its batches, as _tr_loss adds)
        self.batch = None                 # the latest batch and its num_items_in_batch (warm iterations)
        self.abandoned = False
        self.recount = None               # a window's batches whose token count waits for the re-entry's end

    # -- binding (Trainer.train, patched below) --
    def bind(self, trainer: Trainer, resume_from_checkpoint):
        """At `trainer.train(...)` inside a TrainMover run: hook the trainer; the
        `resume_from_checkpoint` to pass on (the marker on a re-entry)."""
        self.trainer = trainer
        state = tm_owner.attach(self)
        self._hook(trainer)
        if state is None:
            return resume_from_checkpoint
        if resume_from_checkpoint not in (None, False):  # the job's start may; a rank taking over uses the live state
            log.info("train(resume_from_checkpoint=%r): re-entering from the live state instead",
                     resume_from_checkpoint)
        extra = state[NAME]
        self.reentry = {**extra, "model": state["model"]["hf_model"],
                        "optimizer": state.get("optimizer", {}).get("hf_optimizer")}
        if self.reentry["optimizer"] is None:  # the runtime's negative control (TM_INJECT=skip-optimizer-state)
            log.warning("the state carries no optimizer: the Trainer's optimizer keeps its own state")
        self.batch = extra["batch"]
        _STATES[MARKER] = extra["trainer_state"]
        return MARKER

    # -- the Trainer's events --
    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            return
        if self.reentry is None:
            tm_owner.entry()  # a fresh start: set-up done
            return
        t = self.trainer
        for name, value in self.reentry["counters"].items():
            setattr(t, name, value)
        t._tr_loss = self.reentry["tr_loss"].to(t.args.device)

    def on_step_begin(self, args, state, control, **kwargs):
        self.loss = 0.0

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer is not None:
            self.pending = True

    def on_epoch_end(self, args, state, control, **kwargs):
        self.epoch_end = self.pending

    # -- the owner's side (script/owner.py) --
    def state(self) -> dict:
        t = self.trainer
        scaler = getattr(t.accelerator, "scaler", None)
        extra = {"trainer_state": _state_dict(t.state),
                 "scheduler": t.lr_scheduler.state_dict() if t.lr_scheduler is not None else None,
                 "scaler": scaler.state_dict() if scaler is not None else None,
                 "counters": {k: getattr(t, k) for k in _COUNTERS},
                 "tr_loss": t._tr_loss.detach().cpu().clone(),
                 "batch": self.batch, "rng": rng.capture()}
        return {"model": {"hf_model": t.model.state_dict()},
                "optimizer": {"hf_optimizer": t.optimizer.state_dict()}, NAME: extra}

    # -- hooks into the trainer (instance attributes: this trainer only) --
    def _hook(self, t: Trainer) -> None:
        def wrap(name, new):
            setattr(t, name, functools.partial(new, getattr(t, name)))

        wrap("training_step", self._training_step)
        if hasattr(t, "_get_num_items_in_batch"):  # transformers >= 5 (the extra's pin): the count's own method
            wrap("_get_num_items_in_batch", self._num_items)
        wrap("_maybe_log_save_evaluate", self._log_save_evaluate)
        wrap("_save_checkpoint", self._only_live)
        wrap("save_model", self._only_live)
        handler = t.callback_handler
        on_log = handler.on_log
        handler.on_log = lambda *a, **k: on_log(*a, **k) if self._live() else a[2]
        # the resume path, from memory (used only when train() got the marker)
        wrap("_load_from_checkpoint", self._load_model)
        wrap("_init_training_state", self._init_training_state)
        wrap("_load_optimizer_and_scheduler", self._load_optimizer_and_scheduler)
        wrap("_load_scaler", self._load_scaler)
        wrap("_load_rng_state", self._load_rng_state)
        wrap("_finalize_training", self._finalize_training)

    def _live(self) -> bool:
        return tm_owner.live() and not self.abandoned

    def _only_live(self, original, *args, **kwargs):
        if self._live():
            return original(*args, **kwargs)
        return None

    def _num_items(self, original, batch_samples, device):
        """The token count of an optimizer step's batches, gathered over the world
        (`average_tokens_across_devices`). A mid-epoch re-entry reaches it before the Trainer
        restores the random state, which is where this run re-enters and goes live: issued
        then, the gather would go to the re-entry's sandbox, and the stayers' gather of this
        step would meet this rank's next collective (a planned move stalled so). The count is
        deferred instead and made at the window's first training step, live, where the stayers'
        order has it: before the step's forward."""
        if self.reentry is None:
            return original(batch_samples, device)
        self.recount = (original, batch_samples, device, None)
        return _DEFERRED

    def _training_step(self, original, model, inputs, num_items_in_batch=None):
        if num_items_in_batch is _DEFERRED:
            count, batches, device, value = self.recount
            if value is None:  # the window's first batch: the count now, with its gather
                value = count(batches, device)
                self.recount = (count, batches, device, value)
            num_items_in_batch = value
        if self.reentry is None:
            self.batch = {"inputs": _plain(copy.deepcopy(inputs)), "num_items": num_items_in_batch}
        loss = original(model, inputs, num_items_in_batch)
        self.loss += float(loss)
        return loss

    def _log_save_evaluate(self, original, *args, **kwargs):
        try:
            original(*args, **kwargs)
        except EndRun:
            self.abandoned = True
            raise
        if not self.pending:
            return
        t = self.trainer
        leaving = t.control.should_epoch_stop or t.control.should_training_stop or float(t.state.epoch).is_integer()
        if self.epoch_end or not leaving:
            self.pending = self.epoch_end = False
            try:
                tm_owner.boundary(self.loss)
            except EndRun:
                self.abandoned = True
                raise

    # -- re-entry: the Trainer's loaders fed from memory --
    def _load_model(self, original, checkpoint, model=None):
        if checkpoint != MARKER:
            return original(checkpoint, model)
        (model or self.trainer.model).load_state_dict(self.reentry["model"])

    def _init_training_state(self, original, max_steps, n_update_per_epoch, n_epochs, checkpoint, trial):
        if checkpoint != MARKER:
            return original(max_steps, n_update_per_epoch, n_epochs, checkpoint, trial)
        # Trainer._init_training_state's resume branch, with the TrainerState from memory (it tests
        # for the file with os.path.isfile, which no loader hook reaches).
        from transformers.trainer import compare_trainer_and_checkpoint_args
        t = self.trainer
        original(max_steps, n_update_per_epoch, n_epochs, None, trial)
        t.state = TrainerState.load_from_json(MARKER)
        compare_trainer_and_checkpoint_args(t.args, t.state)
        t._load_callback_state()
        epochs = int(t.state.global_step // n_update_per_epoch)
        steps = 0
        if not t.args.ignore_data_skip:
            steps = (t.state.global_step % n_update_per_epoch) * t.args.gradient_accumulation_steps
        t.state.init_training_references(t, max_steps, n_epochs, trial)
        return epochs, steps

    def _load_optimizer_and_scheduler(self, original, checkpoint):
        if checkpoint != MARKER:
            return original(checkpoint)
        t, re = self.trainer, self.reentry
        if re["optimizer"] is not None:
            t.optimizer.load_state_dict(re["optimizer"])
        if re["scheduler"] is not None and t.lr_scheduler is not None:
            t.lr_scheduler.load_state_dict(re["scheduler"])

    def _load_scaler(self, original, checkpoint):
        if checkpoint != MARKER:
            return original(checkpoint)
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        if scaler is not None and self.reentry["scaler"] is not None:
            scaler.load_state_dict(self.reentry["scaler"])

    def _load_rng_state(self, original, checkpoint):
        """Where the Trainer restores the random state on resume (the loader is positioned by
        then): warm iterations, their effects undone, the random state, live."""
        if checkpoint != MARKER:
            return original(checkpoint)
        self._reenter()
        return None

    def _finalize_training(self, original, *args, **kwargs):
        self._reenter()  # a state taken at the last step: no epoch is left to run, the re-entry ends here
        return original(*args, **kwargs)

    def _reenter(self) -> None:
        re = self.reentry
        if re is None:
            return
        if re["batch"] is not None:
            self._warm(re)
        rng.restore(re["rng"])
        self.reentry = None
        _STATES.pop(MARKER, None)
        tm_owner.reentered()

    def _warm(self, re: dict) -> None:
        """Training steps on copies of the latest batch through the DDP-wrapped model (its first
        iterations' collectives happen here, in the sandbox); no optimizer step; the model's
        state put back after."""
        t = self.trainer
        model = t.model_wrapped
        sync = t.accelerator.gradient_state.sync_gradients
        t.accelerator.gradient_state._set_sync_gradients(True)
        saved_ga = getattr(t, "current_gradient_accumulation_steps", 1)
        while True:
            t.current_gradient_accumulation_steps = t.args.gradient_accumulation_steps
            t.training_step(model, copy.deepcopy(re["batch"]["inputs"]), re["batch"]["num_items"])
            model.zero_grad(set_to_none=True)
            if not tm_owner.warm():
                break
        t.current_gradient_accumulation_steps = saved_ga
        t.accelerator.gradient_state._set_sync_gradients(sync)
        t.model.load_state_dict(re["model"])


def _wall_clock(key: str) -> bool:
    """A log entry's timing (eval_runtime, eval_samples_per_second, ...): differs run to run."""
    return key.endswith(("_runtime", "_per_second"))


def _state_dict(state: TrainerState) -> dict:
    """The TrainerState as `save_to_json` writes it (dataclasses.asdict), less the wall-clock
    timings in its log history: they are not training state, differ between any two runs, and
    would make every state differ from an uninterrupted run's."""
    import dataclasses
    d = json.loads(json.dumps(dataclasses.asdict(state)))
    d["log_history"] = [{k: v for k, v in entry.items() if not _wall_clock(k)} for entry in d["log_history"]]
    return d


# What a deferred token count hands the Trainer's loop until the window's first training step
# (TrainMoverCallback._num_items): the loop only passes it on to training_step.
_DEFERRED = object()

_STATES: dict[str, dict] = {}  # the TrainerState a re-entering run reads instead of trainer_state.json


def _patch() -> None:
    """`Trainer.train` binds a TrainMoverCallback among its callbacks (a callback is not handed
    the trainer); `TrainerState.load_from_json` reads the marker's state from memory. Both act
    only inside a TrainMover run with the callback; otherwise they call through."""
    if getattr(Trainer.train, "_trainmover", False):
        return
    train, load = Trainer.train, TrainerState.load_from_json.__func__

    @functools.wraps(train)
    def _train(self, resume_from_checkpoint=None, *args, **kwargs):
        cb = next((c for c in self.callback_handler.callbacks if isinstance(c, TrainMoverCallback)), None)
        if cb is not None and current() is not None:
            resume_from_checkpoint = cb.bind(self, resume_from_checkpoint)
        return train(self, resume_from_checkpoint, *args, **kwargs)

    def _load_from_json(cls, json_path):
        saved = _STATES.get(str(json_path).split("/")[0]) if str(json_path).startswith(MARKER) else None
        if saved is None:
            return load(cls, json_path)
        return cls(**copy.deepcopy(saved))

    _train._trainmover = True
    Trainer.train = _train
    TrainerState.load_from_json = classmethod(_load_from_json)


_patch()
