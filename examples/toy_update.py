"""One FlashREINFORCE update on a tiny random transformer, on the CPU, in a few seconds. No downloads.

1. Build a 2-layer Qwen2 (hidden 64, vocabulary 32) from a config.
2. Sample one fresh batch: one rollout per prompt, recording each token's behavior log-prob as we sample.
3. Reward: 1 if the response contains the "target" token, else 0 (a verifiable toy task).
4. Recompute the policy log-probs (and entropies) with gradients, one AdamW step with flashreinforce_loss.

    python examples/toy_update.py [--batch 64] [--negative-token-fraction 0.9]
"""

from __future__ import annotations

import argparse

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from flashreinforce import flashreinforce_loss

EOS, TARGET = 0, 3


def build_model(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         eos_token_id=EOS, bos_token_id=1, pad_token_id=EOS)
    return Qwen2ForCausalLM(config)


@torch.no_grad()
def sample(model: Qwen2ForCausalLM, prompts: torch.Tensor, max_new_tokens: int):
    """Plain temperature-1 sampling; behavior log-probs come from the very distribution we sample from.

    No KV cache: the model is tiny and the point is clarity. Tokens after a row's EOS are still drawn (the
    batch stays rectangular) but masked out. Returns tokens (B, P+N), behavior (B, N), mask (B, N).
    """
    tokens, behavior, masks = prompts, [], []
    alive = torch.ones(prompts.shape[0], dtype=torch.bool)  # (B,)
    for _ in range(max_new_tokens):
        logprobs = model(tokens).logits[:, -1].float().log_softmax(-1)  # (B, V)
        next_token = torch.multinomial(logprobs.exp(), 1)  # (B, 1)
        behavior.append(logprobs.gather(-1, next_token))
        masks.append(alive[:, None].clone())
        alive &= next_token[:, 0] != EOS
        tokens = torch.cat([tokens, next_token], dim=1)
    return tokens, torch.cat(behavior, 1), torch.cat(masks, 1)


def policy_logprobs(model: Qwen2ForCausalLM, tokens: torch.Tensor, num_new: int):
    """Teacher-forced log pi_theta of each generated token, and the full-vocabulary entropy there.  (B, N) x2"""
    logits = model(tokens).logits[:, -num_new - 1 : -1].float()  # (B, N, V) predicts tokens[:, -N:]
    logprobs = logits.log_softmax(-1)
    chosen = logprobs.gather(-1, tokens[:, -num_new:, None]).squeeze(-1)  # (B, N)
    entropies = -(logprobs.exp() * logprobs).sum(-1).detach()  # (B, N)
    return chosen, entropies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--delta", type=float, default=3e-3)
    parser.add_argument("--negative-token-fraction", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model = build_model(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    prompts = torch.randint(4, 32, (args.batch, 4))  # random 4-token prompts, never EOS or TARGET

    model.eval()  # sampling and training share weights and code: the mismatch is only float noise
    tokens, behavior, mask = sample(model, prompts, args.max_new_tokens)
    contains_target = ((tokens[:, -args.max_new_tokens :] == TARGET) & mask).any(-1)  # (B,)
    rewards = contains_target.float()

    current, entropies = policy_logprobs(model, tokens, args.max_new_tokens)
    loss, stats = flashreinforce_loss(current, behavior, rewards, mask, delta=args.delta,
                                      negative_token_fraction=args.negative_token_fraction,
                                      entropies=entropies, failures=~contains_target)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()

    with torch.no_grad():
        after, _ = policy_logprobs(model, tokens, args.max_new_tokens)
    rewarded = mask & contains_target[:, None]
    print(f"batch {args.batch}, reward mean {rewards.mean():.3f}, policy tokens {int(mask.sum())}")
    print(f"loss {loss.item():+.5f}, acceptance rate {stats['acceptance_rate'].item():.3f}, "
          f"max sequence KL {stats['sequence_kl'].max().item():.2e}, "
          f"retained tokens {int(stats['retained_tokens'].sum())}")
    print(f"mean log-prob of rewarded responses' tokens: {current.detach()[rewarded].mean():.4f} -> "
          f"{after[rewarded].mean():.4f} after one step")


if __name__ == "__main__":
    main()
