"""Run assembly: every command builds its run here, from a RunConfig, out of small builders.

    training.py    `train`: the whole job, in order (data, policy, parts, evals, loop, summary)
    sft.py         `sft`;  evaluation.py `eval`;  bench.py `bench`
    data.py        prompts;  policy.py  model + tokenizer (model.path, checkpoint, tiny model + SFT)
    engines.py     ENGINES by rollout.engine;  backends.py  BACKENDS by backend.kind, ENVS by env.kind, the CPU pool
    learner.py     the trainer;  scheduling.py  the scheduler;  hooks.py  metrics, checkpoints, held-out eval
    directory.py   the run directory;  ahrl.py  pass rates and hinted prompts;  tables.py  kind -> builder

A new engine, backend or environment is one builder in its table; this package holds no policy of its own.
"""

from flashreinforce.run.evaluation import EvalRequest, evaluate_checkpoint
from flashreinforce.run.sft import sft_only
from flashreinforce.run.training import run_training

__all__ = ["EvalRequest", "evaluate_checkpoint", "run_training", "sft_only"]
