"""The run's trainer, from trainer.* and algo.*: inline, in a process of its own (backend.trainer_process), or
as trainer.world_size data-parallel ranks in processes of their own (trainer/group.py)."""

from __future__ import annotations

import torch

from flashreinforce.config import RunConfig
from flashreinforce.models.moe import routing_problem
from flashreinforce.run.devices import resolve_device
from flashreinforce.run.policy import Policy, side_numerics
from flashreinforce.run.teachers import load_teachers
from flashreinforce.trainer.distributed import RankGroup, join_group
from flashreinforce.trainer.group import TrainerGroup
from flashreinforce.trainer.lora import LoraSettings
from flashreinforce.trainer.process import TrainerProcess
from flashreinforce.trainer.trainer import (
    OptimizerSettings,
    OverlongShaping,
    Trainer,
    WPSMSettings,
)


def training_state_bytes(config: RunConfig, num_params: int) -> int:
    """What one trainer rank holds for a model of `num_params`: its weights in precision.trainer (fp8 is kept
    dequantized in bf16), and for every trained weight an fp32 master where the weights are not fp32, an fp32
    gradient and AdamW's two fp32 moments; 1/world_size of it on sharded ranks. Activations are not counted: a
    lower bound, which is what makes it safe to refuse a run with. LoRA's adapters are taken as free."""
    return -(-whole_state_bytes(config, num_params) // state_shards(config))


def whole_state_bytes(config: RunConfig, num_params: int) -> int:
    weights = 4 if config.precision.trainer == "fp32" else 2
    trained = 0 if config.trainer.lora is not None else (0 if weights == 4 else 4) + 4 + 8
    return num_params * (weights + trained)


def state_shards(config: RunConfig) -> int:
    return config.trainer.world_size if config.trainer.sharding == "fsdp" else 1


def check_fits_gpu(config: RunConfig, model, device: torch.device) -> None:
    """Before the model moves to a GPU: a trainer rank whose weights, gradients and optimizer state alone exceed
    the GPU's memory stops here, naming the settings that make it fit, instead of failing later out of memory."""
    if device.type != "cuda":
        return
    num_params = sum(p.numel() for p in model.parameters())
    need, gpu = training_state_bytes(config, num_params), torch.cuda.get_device_properties(device)
    if need <= gpu.total_memory:
        return
    ranks = -(-whole_state_bytes(config, num_params) // gpu.total_memory)
    raise ValueError(f"trainer: {num_params / 1e9:.2f}B parameters in precision.trainer={config.precision.trainer} "
                     f"need at least {need / 2**30:.0f} GiB per trainer rank for weights, gradients and AdamW state "
                     f"(activations not counted), more than the {gpu.total_memory / 2**30:.0f} GiB of {gpu.name}: "
                     f"set trainer.world_size={ranks} (or more) with trainer.sharding=fsdp, or train LoRA adapters "
                     "(trainer.lora)")


def build_trainer(config: RunConfig, model, tokenizer, rank: int = 0) -> Trainer:
    """A Trainer of `model` (model and tokenizer, not a Policy: TrainerProcess calls this in its child), with the
    teachers its loss reads (loaded here, in the trainer's own process)."""
    algo, trainer = config.algo, config.trainer
    device = resolve_device("trainer.device", trainer.device, rank=rank)
    check_fits_gpu(config, model, device)
    check_router_replay(config, model)
    freeze_vision(config, model)
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
        task_temperatures=task_temperatures(config),
        max_new_tokens=max(config.for_task(name).rollout.max_new_tokens for name, _ in config.task_list()),
        overlong=OverlongShaping(algo.overlong.max_length, algo.overlong.cache) if algo.overlong else None,
        wpsm=(WPSMSettings(algo.wpsm.tau, algo.wpsm.eta, algo.wpsm.alpha, algo.wpsm.positive_only, algo.wpsm.rate,
                           algo.wpsm.min_rollouts) if algo.wpsm else None),
        minibatches=trainer.minibatches,
        numerics=side_numerics(config, "trainer"),
        router_replay=trainer.router_replay,
        lora=lora_settings(config),
        device=device,
        sharding=trainer.sharding,
        gradient_checkpointing=trainer.gradient_checkpointing,
        pack=trainer.pack,
        teachers=load_teachers(config, tokenizer),
    )


def check_router_replay(config: RunConfig, model) -> None:
    """trainer.router_replay on a mixture-of-experts model whose routes cannot be recorded or replayed (DBRX's,
    models/moe.py) stops here, naming the setting, rather than training without the replay it asked for."""
    problem = routing_problem(model) if config.trainer.router_replay else None
    if problem is not None:
        raise ValueError(f"trainer.router_replay=true, but {problem}: set trainer.router_replay=false to train it "
                         "with the experts its own router picks in the trainer's forward")


def freeze_vision(config: RunConfig, model) -> None:
    """trainer.freeze_vision on a model that reads images: its encoder's parameters stop requiring gradients, so
    AdamW never steps them (the weight pushes still carry them, unchanged)."""
    vision = getattr(model, "vision", None)
    if vision is None:
        return
    if config.trainer.lora is not None:
        raise ValueError("trainer.lora on a model that reads images is not supported yet: set trainer.lora=null")
    freeze = config.trainer.freeze_vision
    if freeze is None:
        freeze = config.model.path is not None
    vision.requires_grad_(not freeze)


def task_temperatures(config: RunConfig) -> dict[str, float] | None:
    """Each task's sampling temperature when a mixture's tasks sample at different ones, else None (one for all)."""
    temperatures = {name: config.for_task(name).rollout.temperature for name, _ in config.task_list()}
    return temperatures if len(set(temperatures.values())) > 1 else None


def build_rank_trainer(config: RunConfig, model, tokenizer, group: RankGroup) -> Trainer:
    """One data-parallel rank: join the group (blocks until every rank has), then build its Trainer. Every
    rank starts from the same `model`, so the ranks' weights are equal before the first step and after each."""
    join_group(group)
    return build_trainer(config, model, tokenizer, rank=group.rank)


def rank_backend(config: RunConfig) -> str:
    """gloo on CPU, NCCL when the trainer computes on GPUs."""
    return "nccl" if resolve_device("trainer.device", config.trainer.device).type == "cuda" else "gloo"


def lora_settings(config: RunConfig) -> LoraSettings | None:
    """trainer.lora as the Trainer's settings; the adapters' init is seeded by the run's seed."""
    lora = config.trainer.lora
    if lora is None:
        return None
    targets = lora.target_modules if isinstance(lora.target_modules, str) else tuple(lora.target_modules)
    return LoraSettings(r=lora.r, alpha=lora.alpha, dropout=lora.dropout, target_modules=targets,
                        rslora=lora.rslora, seed=config.seed, push=lora.push)


def start_trainer(config: RunConfig, policy: Policy) -> Trainer | TrainerProcess | TrainerGroup:
    """The run's trainer: data-parallel ranks in processes when trainer.world_size > 1; else in a process of its
    own when backend.trainer_process is set (overlapped loop only); else inline."""
    threads = config.backend.torch_threads
    if config.trainer.world_size > 1:
        return TrainerGroup(build_rank_trainer, (config, policy.model, policy.tokenizer),
                            world_size=config.trainer.world_size, backend=rank_backend(config), threads=threads,
                            sharded=config.trainer.sharding == "fsdp")
    if config.deterministic or not config.backend.trainer_process:
        return build_trainer(config, policy.model, policy.tokenizer)
    return TrainerProcess(build_trainer, (config, policy.model, policy.tokenizer), threads=threads)
