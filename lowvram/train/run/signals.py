"""SIGINT/SIGTERM: save a checkpoint at the end of the optimizer step, then stop (the CLI exits
130/143 with the command that resumes; a second signal stops at once); and the Trainer callbacks
a run installs for that and for complete checkpoints.

No torch or transformers at import time.
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from lowvram.errors import EXIT_SIGINT, EXIT_SIGTERM, LowvramError
from lowvram.runfiles import checkpoint_folder

if TYPE_CHECKING:
    from types import FrameType
    from typing import TextIO

    from transformers import TrainerControl, TrainerState, TrainingArguments


class TrainingInterrupted(LowvramError):
    """SIGINT/SIGTERM: the run saved a checkpoint and stopped (exit 130/143)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None) -> None:
        name = signal.Signals(signum).name
        where = f"checkpoint saved: {checkpoint}" if checkpoint else "no checkpoint was saved"
        super().__init__(f"interrupted by {name} at step {step}; {where}")
        self.exit_code = EXIT_SIGTERM if signum == signal.SIGTERM else EXIT_SIGINT
        self.checkpoint = checkpoint


class SignalStop:
    """SIGINT/SIGTERM -> save at the end of this optimizer step and stop; a second one stops now."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.signum: int | None = None
        self.stream = stream or sys.stderr
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # asked twice: do not wait for the step
            self.restore()
            raise KeyboardInterrupt
        self.signum = signum
        self.stream.write(f"\n{signal.Signals(signum).name}: saving a checkpoint at the end of this step, "
                          "then stopping (send it again to stop at once)\n")
        self.stream.flush()

    @contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():  # handlers only work there
            yield self
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            self.restore()

    def restore(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous.clear()


def make_callbacks(stop: SignalStop) -> list:
    """The TrainerCallbacks: mark complete checkpoints, honour a pending signal."""
    from transformers import TrainerCallback

    from lowvram.train.run.checkpoints import mark_complete

    class MarkComplete(TrainerCallback):
        # on_save runs after the Trainer wrote the whole folder (trainer.py _maybe_log_save_evaluate).
        def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: object):
            folder = Path(args.output_dir) / checkpoint_folder(state.global_step)
            if state.is_local_process_zero and folder.is_dir():
                mark_complete(folder)

    class StopOnSignal(TrainerCallback):
        def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                        **kwargs: object):
            if stop.signum is not None:
                control.should_save = True
                control.should_training_stop = True
            return control

    class RecordCheckpoint(TrainerCallback):
        # After the Trainer's flow callback and StopOnSignal decided to save, before the folder is
        # written: `--overwrite` deletes it even when the process dies half-way through it.
        def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                        **kwargs: object):
            if control.should_save and state.is_local_process_zero:
                from lowvram.train.run.manifest import record

                record(Path(args.output_dir), checkpoint_folder(state.global_step))

    return [MarkComplete(), StopOnSignal(), RecordCheckpoint()]
