"""Run assembly: every command builds its run here, from a RunConfig, out of small builders.

    training.py    `train`: the whole job, in order (data, policy, parts, evals, loop, summary)
    sft.py         `sft`;  evaluation.py `eval`;  bench.py `bench`
    data.py        prompts;  policy.py  model + tokenizer (model.path, checkpoint, tiny model + SFT)
    engines.py     ENGINES by rollout.engine;  backends.py  BACKENDS by backend.kind, episodes by env.kind, the CPU pool
    learner.py     the trainer;  scheduling.py  the scheduler;  hooks.py  metrics, checkpoints, held-out eval
    directory.py   the run directory;  ahrl.py  pass rates and hinted prompts;  tables.py  kind -> builder

A new engine or backend is one builder in its table (an environment is a class: envs/protocol.py); this
package holds no policy of its own.
"""

from flashreinforce.run.evaluation import EvalRequest, evaluate_checkpoint
from flashreinforce.run.sft import sft_only
from flashreinforce.run.training import run_training

__all__ = ["EvalRequest", "evaluate_checkpoint", "run_training", "sft_only"]
