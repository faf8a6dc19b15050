"""Pure tensor functions: advantages, losses, mismatch weights, aggregation, masks, hint schedule, pass@k.

No models, no I/O, no config objects: tensors and floats in, tensors and floats out. The trainer picks a
loss by name from LOSSES; researchers can import any function on its own.
"""

from flashreinforce.algorithms.advantages import (
    batch_mean_advantages,
    drgrpo_advantages,
    group_mean,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from flashreinforce.algorithms.aggregation import AGGREGATIONS, aggregate
from flashreinforce.algorithms.dapo import dynamic_sampling_keep, overlong_penalty
from flashreinforce.algorithms.distill import sequence_reverse_kl, teacher_signal
from flashreinforce.algorithms.flashreinforce import flashreinforce_loss
from flashreinforce.algorithms.hints import hint_fraction, hinted_prompt
from flashreinforce.algorithms.inputs import GlobalNorm, LossInputs, global_norm
from flashreinforce.algorithms.losses import LOSSES, LossSpec
from flashreinforce.algorithms.mismatch import MISMATCH_MODES, mismatch_weights
from flashreinforce.algorithms.objectives import ClipOptions, FlashReinforceOptions, MiscOptions, OpdOptions
from flashreinforce.algorithms.passk import avg_at_k, pass_at_k
from flashreinforce.algorithms.wpsm import QuerySuccess, mean_token_entropy, wpsm_flags, wpsm_weights

__all__ = [
    "AGGREGATIONS",
    "LOSSES",
    "MISMATCH_MODES",
    "ClipOptions",
    "FlashReinforceOptions",
    "GlobalNorm",
    "LossInputs",
    "LossSpec",
    "MiscOptions",
    "OpdOptions",
    "QuerySuccess",
    "aggregate",
    "avg_at_k",
    "batch_mean_advantages",
    "drgrpo_advantages",
    "dynamic_sampling_keep",
    "flashreinforce_loss",
    "global_norm",
    "group_mean",
    "grpo_advantages",
    "hint_fraction",
    "hinted_prompt",
    "mean_token_entropy",
    "mismatch_weights",
    "overlong_penalty",
    "pass_at_k",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "sequence_reverse_kl",
    "teacher_signal",
    "wpsm_flags",
    "wpsm_weights",
]
