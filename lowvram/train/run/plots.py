"""``loss.png`` at the end of a run: train and eval loss over steps (and memory, when measured).

matplotlib with the Agg backend (no display needed); imported inside the function so that
``lowvram --help`` and plan-only commands never pay for it.
"""

from __future__ import annotations

from pathlib import Path

from lowvram.metrics import RunMetrics

LOSS_PNG = "loss.png"


def save_loss_plot(metrics: RunMetrics | dict, out_dir: str | Path, name: str = LOSS_PNG) -> Path | None:
    """Write ``out_dir/loss.png`` from metrics.json's histories; None if there is nothing to plot.

    Reads ``loss_history`` and ``eval_history`` (``[[step, loss], ...]``) and, if present,
    ``memory_history`` (``[[step, bytes], ...]``) for a second panel. ``metrics``: a RunMetrics,
    or a metrics.json object (read through the schema); a preference run's
    ``rewards_margins_history`` on a second axis of the loss panel; a grpo/rloo run's rewards
    (``reward_history``, ``reward_functions``) in a panel of their own.
    """
    m = metrics if isinstance(metrics, RunMetrics) else RunMetrics.from_dict(metrics)
    train = m.loss_history
    evals = m.eval_history
    if not evals and m.eval_loss is not None and m.steps:
        evals = [[m.steps, m.eval_loss]]  # runs from before eval_history was kept
    memory = m.memory_history
    if not train and not evals:
        return None
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rewards = m.reward_functions or {}
    panels = 1 + bool(memory) + bool(rewards or m.reward_history)
    fig, axes = plt.subplots(panels, 1, figsize=(8, 3.2 * panels + 0.6), squeeze=False, dpi=100)
    ax = axes[0][0]
    if train:
        ax.plot([s for s, _ in train], [v for _, v in train], marker="." if len(train) < 50 else None,
                label="train loss", color="tab:blue")
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], marker="o", label="eval loss", color="tab:orange")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    margins = metrics.get("rewards_margins_history") or []
    if margins:  # dpo/orpo/simpo: TRL's reward margin (chosen - rejected) on a second axis
        rx = ax.twinx()
        rx.plot([s for s, _ in margins], [v for _, v in margins], color="tab:purple", linestyle="--",
                label="reward margin")
        rx.set_ylabel("reward margin")
        rx.legend(loc="upper center")
    ax.legend()
    ax.set_title(_title(m, Path(out_dir).name))
    if rewards or m.reward_history:  # grpo/rloo: the summed reward and each function's mean
        _reward_panel(axes[1][0], m)
    if memory:
        mx = axes[-1][0]
        mx.plot([s for s, _ in memory], [b / 2**30 for _, b in memory], color="tab:green", label="memory")
        predicted = m.predicted_peak_bytes
        if predicted:
            mx.axhline(predicted / 2**30, color="tab:red", linestyle="--", label="predicted peak (seq_len)")
        at_data = m.predicted_peak_bytes_at_data
        if at_data:
            label = f"predicted at the longest row ({m.data_longest_tokens} tokens)"
            mx.axhline(at_data / 2**30, color="tab:purple", linestyle=":", label=label)
        mx.set_xlabel("step")
        mx.xaxis.set_major_locator(MaxNLocator(integer=True))
        mx.set_ylabel("GiB")
        mx.grid(alpha=0.3)
        mx.legend()
    fig.tight_layout()
    path = Path(out_dir) / name
    tmp = path.with_name(f".{name}.tmp.png")
    try:
        fig.savefig(tmp, format="png")
        tmp.replace(path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path


def _reward_panel(ax, m: RunMetrics) -> None:
    """grpo/rloo: the reward (TRL's weighted sum, mean over each log's completions) and each reward
    function's mean over the steps."""
    from matplotlib.ticker import MaxNLocator

    total = m.reward_history or []
    if total:
        ax.plot([s for s, _ in total], [v for _, v in total], color="black", linewidth=2, label="reward (weighted sum)")
    for name, f in (m.reward_functions or {}).items():
        history = f.get("history") or []
        if history and (len(m.reward_functions) > 1 or not total):
            ax.plot([s for s, _ in history], [v for _, v in history], linestyle="--", label=name)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("mean reward")
    ax.grid(alpha=0.3)
    ax.legend()


def _title(m: RunMetrics, run: str) -> str:
    parts = [run]
    if m.train_loss is not None:
        parts.append(f"final train loss {m.train_loss:.3f}")
    if m.eval_loss is not None:
        parts.append(f"eval {m.eval_loss:.3f}")
    return ", ".join(parts)
