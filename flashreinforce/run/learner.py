"""The run's trainer, from trainer.* and algo.*: inline, or in a process of its own (backend.trainer_process)."""

from __future__ import annotations

from flashreinforce.config import RunConfig
from flashreinforce.run.policy import Policy, side_numerics
from flashreinforce.trainer.lora import LoraSettings
from flashreinforce.trainer.process import TrainerProcess
from flashreinforce.trainer.trainer import (
    OptimizerSettings,
    OverlongShaping,
    Trainer,
    WPSMSettings,
)


def build_trainer(config: RunConfig, model, tokenizer) -> Trainer:
    """A Trainer of `model` (model and tokenizer, not a Policy: TrainerProcess calls this in its child)."""
    algo, trainer = config.algo, config.trainer
    return Trainer(
        model,
        loss=algo.loss,
        loss_options=algo.options,
        optimizer=OptimizerSettings(lr=trainer.lr, weight_decay=trainer.weight_decay, betas=tuple(trainer.betas),
                                    warmup_steps=trainer.warmup_steps, total_steps=trainer.steps,
                                    min_lr_ratio=trainer.min_lr_ratio, grad_clip=trainer.grad_clip),
        microbatch_size=trainer.microbatch_size,
        microbatch_tokens=trainer.microbatch_tokens,
        pad_token_id=tokenizer.pad_token_id,
        temperature=config.rollout.temperature,
        max_new_tokens=config.rollout.max_new_tokens,
        overlong=OverlongShaping(algo.overlong.max_length, algo.overlong.cache) if algo.overlong else None,
        wpsm=(WPSMSettings(algo.wpsm.tau, algo.wpsm.eta, algo.wpsm.alpha, algo.wpsm.positive_only)
              if algo.wpsm else None),
        numerics=side_numerics(config, "trainer"),
        router_replay=trainer.router_replay,
        lora=lora_settings(config),
    )


def lora_settings(config: RunConfig) -> LoraSettings | None:
    """trainer.lora as the Trainer's settings; the adapters' init is seeded by the run's seed."""
    lora = config.trainer.lora
    if lora is None:
        return None
    targets = lora.target_modules if isinstance(lora.target_modules, str) else tuple(lora.target_modules)
    return LoraSettings(r=lora.r, alpha=lora.alpha, dropout=lora.dropout, target_modules=targets,
                        rslora=lora.rslora, seed=config.seed)


def start_trainer(config: RunConfig, policy: Policy) -> Trainer | TrainerProcess:
    """The run's trainer: in a process of its own when backend.trainer_process is set (overlapped loop only)."""
    if config.deterministic or not config.backend.trainer_process:
        return build_trainer(config, policy.model, policy.tokenizer)
    return TrainerProcess(build_trainer, (config, policy.model, policy.tokenizer),
                          template=policy.model.state_dict(), threads=config.backend.torch_threads)
