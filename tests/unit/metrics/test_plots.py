"""plot_run draws from metrics.jsonl alone: per-task and per-modality plots appear exactly when the run logged
several tasks or modalities, and a plot without its metric is skipped with the reason."""

import json

from flashreinforce.metrics.plots import plot_run


def write_metrics(run, modalities):
    rows = []
    for step in range(1, 6):
        row = {"step": step, "reward/mean": 0.1 * step, "entropy/mean": 1.0 / step}
        for i, tag in enumerate(modalities):
            row |= {f"modality/{tag}/reward_mean": 0.1 * step + i, f"modality/{tag}/entropy_mean": 1.0 / step + i,
                    f"modality/{tag}/mismatch_k3_kl": 1e-6 * step, f"modality/{tag}/gate_rejected_fraction": 0.0,
                    f"modality/{tag}/masked_fraction": 0.01 * i}
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_each_modality_gets_its_curves(tmp_path):
    write_metrics(tmp_path, ["text", "image"])
    plots = plot_run(tmp_path)
    for name in ("modality_reward", "modality_entropy", "modality_mismatch", "modality_rejections"):
        assert (tmp_path / "plots" / f"{name}.png").is_file(), plots[name]
    assert plots["acceptance_rate"].startswith("skipped: no loss/acceptance_rate")


def test_a_one_modality_run_draws_no_modality_plots(tmp_path):
    write_metrics(tmp_path, [])
    plots = plot_run(tmp_path)
    assert not any(name.startswith("modality_") for name in plots)
    assert (tmp_path / "plots" / "reward.png").is_file()
