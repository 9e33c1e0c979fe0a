"""``tierflow.offload`` for Hugging Face's ``transformers.Trainer``, whose loop you do not own.

Usage::

    from tierflow.integrations.transformers import TierflowCallback

    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=dev,
                      callbacks=[TierflowCallback(budget="60%", policy="tierflow", ssd_dir="/nvme")])
    trainer.train()

How it maps onto the Trainer (``transformers/trainer.py``, ``_inner_training_loop`` and
``_maybe_log_save_evaluate``; events in ``transformers/trainer_callback.py``):

* ``on_train_begin`` opens ``tierflow.offload(model, optimizer, ...)`` around the
  Trainer's own optimizer. The Trainer hands callbacks accelerate's
  ``AcceleratedOptimizer``, which forwards ``step()`` to the torch optimizer inside it;
  the runtime hooks that inner optimizer, whose ``step()`` ends an iteration.
* Gradient accumulation needs nothing: an iteration runs from the model's first forward
  to ``optimizer.step()``, so the K micro-batches of one optimizer step, the loss
  bookkeeping and the gradient clipping between them are one iteration, profiled once
  and followed every step after.
* Evaluation runs after ``on_step_end`` (or ``on_epoch_end``) when the Trainer has set
  ``control.should_evaluate``, and ends with ``on_evaluate``. In between, the callback
  holds ``run.untracked()``: the evaluation's forwards (under ``torch.no_grad()``) are
  not ops of any iteration, so they are neither profiled nor a departure from the plan;
  what they read is brought to the device on demand, within the budget.
* A checkpoint (``control.should_save``) serialises parameters and optimizer state by
  reading their memory directly, which an evicted storage no longer has. So before a
  save the callback closes the run (every tensor comes home) and opens a new one at the
  next ``on_step_begin``, which profiles one iteration again. ``runs`` keeps them all.
* ``on_train_end`` closes the run. If ``train()`` raises, no event follows: call
  :meth:`TierflowCallback.close` (the model and optimizer are whole again after it).

The runtime begins an iteration at the model's first forward; a forward inside
``untracked()`` must not begin one, or the data loading that follows an evaluation (the
DataLoader's ``record_function`` op) would become the first op of a planned iteration and
a departure from the plan; :class:`tierflow.runtime.Run` follows that rule.

Limits: one process (the Trainer's DDP/FSDP wrapping is not handled here; use
``tierflow.offload`` in your own loop for that, see docs/distributed.md). The evaluation's
own on-demand fetches are counted in ``stats.stalls``; its activations are not counted
against the budget (as for any ``untracked()`` op).
"""

from __future__ import annotations

import contextlib
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - exercised only where transformers is absent
    raise ImportError(
        "tierflow.integrations.transformers needs Hugging Face transformers "
        "(pip install 'transformers[torch]')"
    ) from e

from ..runtime import Run


class TierflowCallback(TrainerCallback):
    """Train under ``tierflow.offload`` inside ``transformers.Trainer``.

    Args:
        budget: device bytes the run may use, as for :func:`tierflow.offload`: a size
            (``"20GiB"``) or a share of the profiled iteration's peak (``"60%"``).
        policy: the planning policy (``tierflow policies`` lists them).
        ssd_dir: directory for the SSD tier's file (none: host memory only).
        **options: passed to :func:`tierflow.offload` (``hardware``, ``host_bytes``,
            ``policy_options`` ...).

    Attributes:
        run: the open :class:`~tierflow.runtime.Run` while training (None outside).
        runs: every run this callback opened (one, plus one after each checkpoint).

    Example:
        >>> # trainer = Trainer(model=model, args=args, train_dataset=ds,
        >>> #                   callbacks=[TierflowCallback(budget="60%")])
        >>> # trainer.train(); cb.runs[0].stats.moved_bytes
    """

    def __init__(self, budget: str | int | float | None = None, policy: Any = "tierflow",
                 ssd_dir: Any = None, **options: Any):
        self.budget, self.policy, self.ssd_dir, self.options = budget, policy, ssd_dir, options
        self.run: Any = None
        self.runs: list[Any] = []
        self._aside: contextlib.ExitStack | None = None  # holds run.untracked() during evaluation
        self._model: Any = None
        self._optimizer: Any = None

    # -- the run's life -------------------------------------------------------------------
    def _open(self) -> None:
        if self.run is None:
            run = Run(self._model, self._optimizer, budget=self.budget, policy=self.policy,
                      ssd_dir=self.ssd_dir, **self.options)
            run.__enter__()
            self.run = run
            self.runs.append(run)

    def close(self) -> None:
        """Leave evaluation and close the run (every tensor brought home). Idempotent."""
        self._leave_evaluation()
        run, self.run = self.run, None
        if run is not None:
            run.__exit__(None, None, None)

    def _enter_evaluation(self) -> None:
        if self.run is not None and self._aside is None:
            self._aside = contextlib.ExitStack()
            self._aside.enter_context(self.run.untracked())

    def _leave_evaluation(self) -> None:
        aside, self._aside = self._aside, None
        if aside is not None:
            aside.close()

    def _before_log_save_evaluate(self, args: Any, control: Any) -> None:
        # what the Trainer does next: evaluate (under untracked) and/or save (run closed)
        best = str(getattr(args, "save_strategy", "")).lower().endswith("best")
        if control.should_save or (best and control.should_evaluate):
            self.close()
        elif control.should_evaluate:
            self._enter_evaluation()

    # -- Trainer events ----------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None:
            raise ValueError("TierflowCallback: the Trainer passed no model to on_train_begin")
        self._model = model
        # accelerate's AcceleratedOptimizer wraps the torch optimizer whose step() the
        # runtime hooks (the wrapper's own step() runs no optimizer hooks)
        self._optimizer = getattr(optimizer, "optimizer", optimizer)
        self._open()
        if getattr(args, "eval_on_start", False):
            self._enter_evaluation()

    def on_step_begin(self, args, state, control, **kwargs):
        self._leave_evaluation()
        self._open()  # after a checkpoint closed the run

    def on_step_end(self, args, state, control, **kwargs):
        self._before_log_save_evaluate(args, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._before_log_save_evaluate(args, control)

    def on_evaluate(self, args, state, control, **kwargs):
        self._leave_evaluation()

    def on_train_end(self, args, state, control, **kwargs):
        self.close()


__all__ = ["TierflowCallback"]
