"""Engine: placeholder plain-PyTorch loop with the final API (replaced by the offload engine)."""

from __future__ import annotations

import time

import psutil
import torch

from engine.config import EngineConfig, check_margin, parse_size
from engine.policy import Policy
from engine.telemetry import MemorySnapshot, StepStats


class Engine:
    def __init__(self, model: torch.nn.Module, config: EngineConfig) -> None:
        self.model = model
        self.config = config
        self.budget = parse_size(config.device_budget or 6 * 1024**3)
        self.opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas,
                                     eps=config.eps, weight_decay=config.weight_decay,
                                     fused=True)
        self.step_count = 0

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def set_policy(self, policy: str) -> None:
        self.config.policy = Policy.parse(policy).value

    def set_margin(self, ratio: float) -> None:
        self.config.margin_ratio = check_margin(ratio)

    def set_budget(self, budget: int | str) -> None:
        self.budget = parse_size(budget)

    def snapshot(self) -> MemorySnapshot:
        return MemorySnapshot(self.budget, 0, 0, 0, 0, psutil.Process().memory_info().rss,
                              {}, [])

    def step(self, batch: dict) -> StepStats:
        t0 = time.perf_counter()
        self.model.train()
        out = self.model(**batch)
        t1 = time.perf_counter()
        out.loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        self.step_count += 1
        return StepStats(self.step_count, float(out.loss), int(batch["input_ids"].numel()),
                         t3 - t0, t1 - t0, t2 - t1, t3 - t2, 0.0, 0, 0, self.config.policy,
                         self.config.margin_ratio, self.budget, self.snapshot())

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().float().clone() for k, v in self.model.state_dict().items()}
