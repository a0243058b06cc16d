"""cuttle.rl: GRPO-style RL over the cuttle engine, token-in / token-out.

Map (docs/rl.md): `types` (Sample, Group, Trajectory), `rollout` (sample_groups over an `LLM` or
any TokenSampler), `client` (the same over HTTP), `rewards` / `code_reward`, `advantages`,
`losses`, `batch` (TrainBatch, PackedBatch), `mismatch`, `trainer` (reference trainer + weight
push), and for multi-turn coding agents `chat` (the chat template as token deltas), `environment`
(sandboxed task environments), `agent` (the agent loop) and `ray_rollout` (Ray workers under one
controller; the only module that imports ray). Prompts may carry squid documents
(`{"prefix", "documents", "prompt"}`): groups keep the engine's `SquidLayout` and the trainer
scores under its mask and positions. Imports only the
engine; the sandbox and ray only through the submodules named above, which it does not import.
"""
from cuttle.rl.advantages import compute_advantages, drop_zero_variance, group_advantages
from cuttle.rl.batch import PackedBatch, TrainBatch
from cuttle.rl.losses import LOSSES, LossConfig, loss_config, policy_loss
from cuttle.rl.mismatch import Mismatch, mismatch
from cuttle.rl.rewards import RewardFn, assign_rewards, python_function_reward
from cuttle.rl.rollout import TokenSampler, extend_trajectories, sample_groups
from cuttle.rl.types import Group, Sample, Trajectory

__all__ = [
    "LOSSES",
    "Group",
    "LossConfig",
    "Mismatch",
    "PackedBatch",
    "RewardFn",
    "Sample",
    "TokenSampler",
    "TrainBatch",
    "Trajectory",
    "assign_rewards",
    "compute_advantages",
    "drop_zero_variance",
    "extend_trajectories",
    "group_advantages",
    "loss_config",
    "mismatch",
    "policy_loss",
    "python_function_reward",
    "sample_groups",
]
