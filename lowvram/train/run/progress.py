"""Progress while training: a rich bar (step, loss, tokens/s, ETA) on a terminal, plain log lines
otherwise. Also records the loss history and tokens seen for metrics.json.

transformers is imported at module level because the callback subclasses TrainerCallback; only
run.py imports this module, inside run_training.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from transformers import TrainerCallback

from lowvram.train.build.grpo import rl_progress

if TYPE_CHECKING:
    from typing import TextIO

    from transformers import TrainerControl, TrainerState, TrainingArguments


class ProgressCallback(TrainerCallback):
    """A TrainerCallback; `losses` is [(step, loss)] as logged, `eval_losses` likewise."""

    def __init__(self, tty: bool | None = None, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.losses: list[tuple[int, float]] = []
        self.eval_losses: list[tuple[int, float]] = []
        self.tokens_seen = 0
        self._tokens_at_start = 0
        self._step_at_start = 0
        self._t0 = 0.0
        self._progress = None
        self._task = None
        self._warned_climb = False
        self._rl = ""  # grpo/rloo: the last log's rewards (train/build/grpo.py rl_progress)

    # -- helpers -------------------------------------------------------------------------------

    def session_tokens(self) -> int:
        """Tokens trained in this process (a resumed run starts from the checkpoint's count)."""
        return self.tokens_seen - self._tokens_at_start

    def tokens_per_s(self) -> float | None:
        elapsed = time.perf_counter() - self._t0 if self._t0 else 0.0
        new = self.session_tokens()
        return new / elapsed if elapsed > 0 and new > 0 else None

    def _eta(self, step: int, max_steps: int) -> str:
        done = step - self._step_at_start
        if done <= 0 or not self._t0:
            return "?"
        left = (time.perf_counter() - self._t0) / done * (max_steps - step)
        return f"{int(left // 60)}:{int(left % 60):02d}"

    def _line(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    # -- Trainer events ------------------------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: object):
        self._t0 = time.perf_counter()
        self._step_at_start = state.global_step
        self.tokens_seen = self._tokens_at_start = int(state.num_input_tokens_seen or 0)
        if self.tty:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=state.max_steps, completed=state.global_step, info="")
        else:
            resumed = f" (resumed at step {state.global_step})" if state.global_step else ""
            self._line(f"training: {state.max_steps} steps{resumed}")

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: object):
        self.tokens_seen = int(state.num_input_tokens_seen or 0) or self.tokens_seen
        if control is not None and state.max_steps and state.global_step >= state.max_steps:
            control.should_log = True  # the final loss is the last step's, whatever logging_steps is
        self._update_bar(state)
        return control

    def _update_bar(self, state: TrainerState, climb: float | None = None) -> None:
        if self._progress is not None:
            loss = f"loss {self.losses[-1][1]:.4f}  " if self.losses else ""
            tps = self.tokens_per_s()
            info = loss + (f"{tps:,.0f} tok/s" if tps else "") + (f"  {self._rl}" if self._rl else "")
            info += f"  diverging: {climb:.1f}x" if climb else ""
            self._progress.update(self._task, completed=state.global_step, info=info)

    def _climb(self, state: TrainerState) -> tuple[float | None, str | None]:
        """(the loss's factor over its first logged value while it climbs, lowvram.metrics
        loss_climb over the whole history, a resumed run's too; the warning in full, said once)."""
        from lowvram.metrics import climb_warning, loss_climb

        logged = getattr(state, "log_history", None) or ()
        if any("reward" in e for e in logged):  # grpo/rloo: the loss is no measure of divergence
            return None, None
        history = [[e["step"], e["loss"]] for e in logged if "loss" in e and "step" in e]
        climb = loss_climb(history)
        if climb is None or self._warned_climb:
            return climb, None
        self._warned_climb = True
        return climb, climb_warning(history)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: object):
        logs = logs or {}
        step = state.global_step
        if "num_tokens" in logs and not state.num_input_tokens_seen:  # TRL's grpo/rloo count (prompt + completion)
            self.tokens_seen = int(logs["num_tokens"])
        self._rl = rl_progress(logs) or self._rl
        if "loss" in logs:
            self.losses.append((step, float(logs["loss"])))
            climb, warning = self._climb(state)
            self._update_bar(state, climb)  # the step's own loss (on_step_end ran before this log)
            if self._progress is None:
                tps = self.tokens_per_s()
                self._line(
                    f"step {step}/{state.max_steps}  loss {logs['loss']:.4f}  lr {logs.get('learning_rate', 0):.2e}"
                    + (f"  {tps:,.0f} tok/s" if tps else "") + f"  eta {self._eta(step, state.max_steps)}"
                    + (f"  {self._rl}" if "reward" in logs else "")
                    + (f"  warning: diverging, loss {climb:.1f}x its first" if climb else "")
                )
            if warning:
                self._line(f"warning: {warning}")
        if "eval_loss" in logs:
            self.eval_losses.append((step, float(logs["eval_loss"])))
            self._line(f"step {step}/{state.max_steps}  eval loss {logs['eval_loss']:.4f}")

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: object):
        if self._progress is None:
            self._line(f"step {state.global_step}: checkpoint saved")

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: object):
        self.tokens_seen = int(state.num_input_tokens_seen or 0) or self.tokens_seen
        if self._progress is not None:
            self._progress.update(self._task, completed=state.global_step)
        self.close()

    def close(self) -> None:
        """End the bar (the run ended, or stopped with an error)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
