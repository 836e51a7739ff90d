"""The advantage estimator's side of a learner step: a batch's samples as `AdvantageInputs` (groups, mask,
rewards, and for the estimators that read them process rewards, greedy baseline members and role keys),
and a stateful estimator's state (RAE's baselines): checkpointed, and kept identical over data-parallel
ranks by its `sync` hook, an all-gather of each key's values.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tidal.algos.estimators import AdvantageInputs
from tidal.core.episodes import ROLE_KEY
from tidal.integration.learner.data import Sample, pad_rows

log = logging.getLogger("tidal.learner")


class Advantages:
    """`estimator` (registered as `name`) applied to a step's samples. `sp`: the learner's sequence
    parallelism (its groups' ranks hold the same samples), or None."""

    def __init__(self, estimator: Any, name: str, sp: Any = None) -> None:
        self.estimator, self.name, self.sp = estimator, name, sp
        self.uses_steps = bool(getattr(estimator, "uses_step_rewards", False))
        self.uses_roles = bool(getattr(estimator, "uses_role_keys", False))
        self.warned_steps = False
        # an estimator with state across steps (`state_dict`): the trainer takes its advantages in `step`,
        # batch after batch as trained (never ahead in `prepare`), and checkpoints its state
        self.stateful = callable(getattr(estimator, "state_dict", None))
        self.synced = self._sync()  # every rank must then call it each step, even with an empty share

    def __call__(self, samples: Sequence[Sample], values: list[torch.Tensor] | None = None
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per-sample advantages (and value targets in PPO mode, from the critic's `values`)."""
        groups: dict[str, int] = {}
        index = torch.tensor([groups.setdefault(s.group_id, len(groups)) for s in samples], dtype=torch.long)
        width = max((len(s.completion) for s in samples), default=0)  # none: a synced estimator's empty share
        mask = pad_rows([torch.from_numpy(s.loss_mask) for s in samples], width, False).bool()
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        v = pad_rows([x.float().cpu() for x in values], width) if values is not None else None
        step_rewards, step_ends = self._steps(samples)
        out = self.estimator(AdvantageInputs(rewards=rewards, mask=mask, group_index=index, values=v,
                                             step_rewards=step_rewards, step_ends=step_ends,
                                             baseline=self._baseline(samples), role_keys=self._role_keys(samples)))
        adv = [out.advantages[i, : len(s.completion)] for i, s in enumerate(samples)]
        ret = [out.returns[i, : len(s.completion)] for i, s in enumerate(samples)] if out.returns is not None else None
        return adv, ret

    def state_dict(self) -> dict[str, Any]:
        """{"advantage": the estimator's state} (JSON-able), or {} when it keeps none."""
        return {"advantage": self.estimator.state_dict()} if self.stateful else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (every rank loads the same, rank 0's)."""
        saved = state.get("advantage")
        if saved is None:
            if self.stateful:
                log.info("the checkpoint holds no state of advantage %r: it starts afresh", self.name)
        elif not self.stateful:
            log.warning("the checkpoint holds an advantage estimator's state, which advantage %r does not keep: "
                        "ignored (was the run started with another advantage?)", self.name)
        else:
            self.estimator.load_state_dict(saved)

    def _sync(self) -> bool:
        """Data-parallel ranks each train a share of the batch: a stateful estimator sees every rank's share
        of each batch through its `sync` hook (a collective), so that the ranks' states stay identical.
        True when it is synced so."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if not self.stateful or world == 1:
            return False
        if not hasattr(self.estimator, "sync"):
            raise ValueError(f"advantage {self.name!r} keeps state across steps (state_dict) but has no `sync` hook "
                             f"to see the whole batch: on {world} data-parallel ranks each rank's state would follow "
                             f"its own share and drift apart; train it with one rank")
        self.estimator.sync = self._gather
        return True

    def _gather(self, mine: dict[str, list[float]]) -> dict[str, list[float]]:
        """Every data-parallel share's `mine` (key -> values), joined in rank order. The ranks of an SP group
        hold the same share: its leader's is counted, once."""
        own = mine if self.sp is None or self.sp.leader else {}
        every: list[dict[str, list[float]]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(every, own)
        out: dict[str, list[float]] = {}
        for part in every:
            for key, values in part.items():
                out.setdefault(key, []).extend(values)
        return out

    def _baseline(self, samples: Sequence[Sample]) -> torch.Tensor | None:
        """[B] bool, the groups' greedy baseline members, for an estimator that reads them (ReMax's)."""
        if getattr(self.estimator, "greedy_baseline", False):
            return torch.tensor([s.baseline for s in samples], dtype=torch.bool)
        if any(s.baseline for s in samples):
            raise ValueError(f"the batch holds greedy baseline members (ReMax's), which advantage {self.name!r} does "
                             f"not read: its groups were generated for advantage \"remax\"; set "
                             f"learner.train.advantage = {{ name = \"remax\" }}")
        return None

    def _role_keys(self, samples: Sequence[Sample]) -> list[str] | None:
        """[B] each sample's "<task>/<role>", for an estimator that conditions on roles (`uses_role_keys`)."""
        if not self.uses_roles:
            return None
        missing = [s.id for s in samples if not s.role_key]
        if missing:
            raise ValueError(f"advantage {self.name!r} conditions on each sample's role, but trajectory {missing[0]} "
                             f"(and {len(missing) - 1} more this step) carries none (metadata {ROLE_KEY!r}, set by "
                             f"multi-role episodes): train single-role environments with another advantage, e.g. "
                             f"\"grpo\"")
        return [s.role_key for s in samples]

    def _steps(self, samples: Sequence[Sample]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Process rewards [B, S] and their end positions [B, S] (-1: no step) for an estimator that reads
        them (`uses_step_rewards`); (None, None) for the others, which train on the outcome alone."""
        with_steps = [s for s in samples if s.step_ends is not None and len(s.step_ends)]
        if not with_steps:
            return None, None
        if not self.uses_steps:
            if not self.warned_steps and any(np.any(s.step_rewards) for s in with_steps):
                self.warned_steps = True
                log.warning("samples carry step (process) rewards, but advantage estimator %r does not read "
                            "them: training on the outcome reward only (advantage.name = \"grpo_process\" "
                            "uses both)", self.name)
            return None, None
        width = max(len(s.step_ends) for s in with_steps)  # type: ignore[arg-type]
        rewards = torch.zeros((len(samples), width), dtype=torch.float32)
        ends = torch.full((len(samples), width), -1, dtype=torch.long)
        for i, s in enumerate(samples):
            if s.step_ends is not None and len(s.step_ends):
                n = len(s.step_ends)
                rewards[i, :n] = torch.tensor(np.asarray(s.step_rewards, np.float32))
                ends[i, :n] = torch.tensor(np.asarray(s.step_ends, np.int64))
        return rewards, ends
